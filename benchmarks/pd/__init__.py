"""PD against colocated on GPUs (`pdserve launch` + `pdserve bench`)."""
