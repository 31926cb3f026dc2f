"""A test-only fault: the engine step of a request whose prompt holds a given token id raises
torch.OutOfMemoryError, as a step that ran out of device memory does (tests/e2e/test_engine_failure.py).

    PDSERVE_TEST_FAULT=<role>:<token id>     e.g. prefill:7 (roles: prefill, decode, colocated)

Read here and nowhere else, once per worker; unset (always, outside tests) it is never consulted.
"""

from __future__ import annotations

import os

import torch

ENV = "PDSERVE_TEST_FAULT"


class FaultHook:
    def __init__(self, role: str, token_id: int) -> None:
        self.role = role
        self.token_id = token_id
        self.armed = False

    @classmethod
    def from_env(cls) -> FaultHook | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        role, _, token = spec.partition(":")
        return cls(role, int(token))

    def see(self, role: str, prompt_token_ids: list[int]) -> None:
        """A request was added: arm the fault if it is the one the test named."""
        if role == self.role and self.token_id in prompt_token_ids:
            self.armed = True

    def fire(self) -> None:
        """Before a step: raise if armed (once: a worker that stays up would fail only this step)."""
        if self.armed:
            self.armed = False
            raise torch.OutOfMemoryError(f"injected by {ENV} (token {self.token_id})")
