"""What the drafter and verifier cores share: the loaded model and how it runs,
the session table, the lock, and the checks every new session passes."""
from __future__ import annotations

import threading

import torch

from .errors import CapacityExceeded, InvalidRequest, UnknownSession
from .models import Runner, context_length, load_model, vocab_size
from .sampling import SamplingParams
from .validation import check_token_ids


class ModelCore:
    role = "model"          # "drafter" | "verifier", for messages

    def __init__(self, config, model=None):
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.model = model if model is not None else load_model(config.model_dir, config.device, config.dtype)
        self.runner = Runner(self.model, config.engine)
        self.vocab_size = vocab_size(self.model)
        self.context_length = context_length(self.model.config)
        self._sessions: dict = {}
        # One forward at a time: concurrent forwards on 2 CPU cores only thrash.
        # (Batching concurrent sessions into one forward is a later step.)
        self._lock = threading.Lock()

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def _check_request(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """The input checks of a new session (no lock needed)."""
        params.validate()
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        check_token_ids(prompt_ids, self.vocab_size, self.context_length, "prompt_token_ids")

    def _check_room(self, session_id: str) -> None:
        """Under the lock: the id is new and the session table has room."""
        if session_id in self._sessions:
            raise InvalidRequest(f"session {session_id!r} is already open")
        if len(self._sessions) >= self.config.max_sessions:
            raise CapacityExceeded(f"{self.role} is at its limit of {self.config.max_sessions} sessions")

    def close_session(self, session_id: str) -> None:
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise UnknownSession(f"unknown session id {session_id!r}")

    def _live(self, jobs: list) -> list:
        """The jobs (checked calls) whose session is still the one they were
        checked against: not closed while they waited for their batch."""
        return [j for j in jobs if self._sessions.get(j.session_id) is j.session]

    @staticmethod
    def _in_order(jobs: list, done: dict, call: str) -> list:
        """Each job's result (done: id(job) -> result), or UnknownSession for a job
        whose session was closed during its call."""
        return [done[id(j)] if id(j) in done else
                UnknownSession(f"session {j.session_id!r} was closed during its {call} call") for j in jobs]

    def _get(self, session_id: str):
        s = self._sessions.get(session_id)
        if s is None:
            raise UnknownSession(f"unknown session id {session_id!r}")
        return s
