"""MTP drafting through PD: what the prefill worker hands the decode worker beside the KV.

The prefill worker runs the MTP layer over the prompt as a colocated engine does (mtp.py's pass
after each step: the last prefill chunk's rows pair the prompt's last position with the first
token), so the MTP layer's records travel with the other layers' (one more layer of the pool:
disagg/layout.py counts it like any other). What the records do not hold is g_{n-1}, the layer's
output at the prompt's last position, from which the first draft is d_1 = argmax(head(g_{n-1}))
and the chain goes on: it travels as `KVHandle.mtp_hidden` ([H] values of the model's dtype, raw
bytes in base64), and the decode worker drafts from it before its first step (`MTPDrafter.
propose_loaded`). DeepSeek-V4's g is its residual streams [N, H] (`row_shape`, which also shapes
the TP ranks' MTP input), and its MTP records are one more layer of the window region: those of
the prompt's last W - 1 positions travel in the window blocks, all the first draft reads (the
layer has no compressor state). Both sides draft with MTP or neither does (`mtp_problem`: a hand-off with the
hidden state to a decode worker without MTP, or one without it to a decode worker with MTP, fails
the request with that reason; the pools' layouts differ anyway).
"""

from __future__ import annotations

import base64
import math

import torch

from pdserve.engine.spec_decode.config import MTP_PAIR


def row_shape(model) -> tuple[int, ...]:
    """The shape of one row of the MTP layer's input and output: [H], DeepSeek-V4's [N, H] (its
    residual streams: `mtp_source`)."""
    H = model.config.hidden_size
    return (model.config.v4.hc_mult, H) if hasattr(model, "mtp_source") else (H,)


def encode(g: torch.Tensor) -> str:
    """g [H] (V4: [N, H]) -> KVHandle.mtp_hidden."""
    raw = g.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
    return base64.b64encode(raw).decode("ascii")


def decode(text: str, dtype: torch.dtype, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    """KVHandle.mtp_hidden -> g of `shape` (row_shape; its length checked by mtp_problem)."""
    raw = bytearray(base64.b64decode(text))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape).to(device)


def hidden_bytes(config, model, dtype: torch.dtype) -> int | None:
    """The bytes of g a hand-off to this engine carries; None when it does not draft with MTP."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return None
    return math.prod(row_shape(model)) * dtype.itemsize


def mtp_problem(mtp_hidden: str | None, nbytes: int | None) -> str | None:
    """Why a hand-off cannot go on here (nbytes: hidden_bytes of this engine), or None."""
    if mtp_hidden is None and nbytes is not None:
        return f"the prefill worker ran without MTP drafts, this decode worker drafts with them: {MTP_PAIR}"
    if mtp_hidden is not None and nbytes is None:
        return f"the prefill worker ran with MTP drafts, this decode worker without them: {MTP_PAIR}"
    if nbytes is not None:
        try:
            got = len(base64.b64decode(mtp_hidden, validate=True))
        except ValueError:
            return "kv_handle.mtp_hidden is not base64"
        if got != nbytes:
            return f"kv_handle.mtp_hidden holds {got} bytes; this model's MTP input row has {nbytes}"
    return None
