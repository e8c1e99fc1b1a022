"""A greedy Generate stream in a background thread that the test can hold
open: the scaling tests need streams still running when a scale step ends,
and a fixed token count cannot promise that (a fast machine finished 3500
tokens before a slow `specd scale` returned).

The stream reads freely until it has `hold_at` tokens, then stops reading until
the test sets `release`. Its channel announces a tiny HTTP/2 window with no
window growth (BDP probing off), so the orchestrator's writes wait as soon as a
few unread messages are in flight: the session pauses on the replicas, still
open, instead of running to its end. The margin between `hold_at` and
`max_new` must exceed what that window lets through (about 25 messages of at
most k+1 tokens each)."""
import threading

import grpc

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

WINDOW_BYTES = 256
HOLD_MARGIN = 200          # tokens; > 25 messages x (3 + 1) tokens
CHANNEL_OPTIONS = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", WINDOW_BYTES),
    ("grpc.use_local_subchannel_pool", 1),      # a TCP connection of its own
]


def open_held_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class HeldStream(threading.Thread):
    """One Generate stream (k=3, greedy); keeps every token, its finish reason
    and any error. It pauses at max_new - HOLD_MARGIN tokens until `release`
    is set (shared by the test's streams)."""

    def __init__(self, address, prompt, max_new, release: threading.Event, timeout=900, channel=None):
        super().__init__(daemon=True)
        self.channel = channel or open_held_channel(address)  # channel: one of open_held_channel's
        self.prompt, self.max_new, self.release, self.timeout = prompt, max_new, release, timeout
        self.hold_at = max_new - HOLD_MARGIN
        assert self.hold_at > 0, f"max_new {max_new} leaves no room for the hold margin {HOLD_MARGIN}"
        self.tokens, self.error, self.finish = [], None, None
        self.held = threading.Event()
        self.start()

    def run(self):
        try:
            for r in pb_grpc.OrchestratorServiceStub(self.channel).Generate(pb.GenerateRequest(
                    prompt_token_ids=pb.PromptTokenIds(ids=self.prompt), max_new_tokens=self.max_new,
                    num_speculative_tokens=3), timeout=self.timeout):
                self.tokens += r.token_ids
                self.finish = r.finish_reason or self.finish
                if len(self.tokens) >= self.hold_at and not self.release.is_set():
                    self.held.set()
                    self.release.wait()
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"
        finally:
            self.channel.close()
