"""The nixl transfer backend (UCX): the decode worker READs the prefill worker's KV.

    ucx_env.py    the UCX variables a pool on the GPU needs, set before UCX loads
    metadata.py   what peers tell each other: NixlPeerInfo (JSON over HTTP), the hand-off prefix
    agent.py      the worker's NIXL agent, its notifications and its progress thread
    loads.py      one object per in-flight load, a class per transport (blocks, staged, cuda_ipc)
    options.py    NixlOptions, the backend's own settings
    connector.py  NixlConnector, built by disagg/factory.py as backend "nixl"

    prefill NixlConnector                               decode NixlConnector
    register_kv_cache: register regions once            register_kv_cache: register regions once
    peer_metadata() -> NixlPeerInfo JSON  <--HTTP-->    peer_metadata() (each worker fetches the
                                                          other's: worker/peers.py)
    send_handoff: add_remote_agent once per decode
      instance, notif "handoff:<Handoff JSON>" ------>  poll_handoffs: get_new_notifs
                                                        start_load(handle, blocks, peer): the shared
                                                          checks (leasing_connector.py), then
                                                          add_remote_agent once per engine instance
    on_prefill_finished: lease(blocks),                   and a load (loads.py): a copy from the
      gather into a slab of the staging arena               mapped pool (same host), a READ of the
                                                            staged slab into landing room, or a
                                                            READ of the blocks
    poll_releases: get_new_notifs  <--"release:<id>"--  poll_loads: each load's poll() until done
                   + expired leases (slabs freed)         (then the release), failed, or past the
                                                          transfer timeout

Every NIXL failure becomes a TransferError naming the request, the stage and the reason. On CPU,
UCX picks cma for data and tcp for messages; no UCX variables are needed. Over cma a large READ
may complete inside transfer(), so start_load then costs the copy itself.

On one host (pools on GPUs, the same boot id) the decode side does not READ at all: it maps the
prefill pool through CUDA IPC once per peer instance and copies a request's blocks with one kernel
of its own (cuda_ipc.py); NIXL still carries the metadata, the hand-off and the release. The
prefill side then skips the staging gather for that decode worker (its metadata says it maps
same-host peers). A peer that cannot be mapped is read over NIXL, with a warning.

Nothing is imported here: disagg/factory.py imports connector.py only when the backend is named
(it loads UCX).
"""
