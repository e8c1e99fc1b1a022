"""Deliberately wrong structured-output implementations, for showing that
tests/test_structured_lossless.py's law test can fail.

A Stack started with this folder on PYTHONPATH and SPECD_WRONG_VARIANT set
runs every service process with one rule broken (Python imports
`sitecustomize` at start-up). Never on the path of a real deployment.

* advance_on_rejected: a matcher is never rolled back from a draft's
  tentative path: committed tokens are consumed on top of the last draft node
  it looked at, accepted or not.
"""

import os

VARIANT = os.environ.get("SPECD_WRONG_VARIANT", "")


def _commit_on_tentative(self, tokens, what=""):
    self._m.try_consume_tokens(list(tokens))
    self._path = []  # believes it stands at the committed state


if VARIANT == "advance_on_rejected":
    from specd_core.runtime import grammar

    grammar.Constraint.commit = _commit_on_tentative
elif VARIANT:
    raise SystemExit(f"SPECD_WRONG_VARIANT: unknown variant {VARIANT!r}")
