"""A model given by local directory or by Hugging Face repo id, as a local directory.

`--target`, `--drafter` and the services' `--model` take either. A repo id
(`org/name`, `name`, optionally `@revision`) is resolved with huggingface_hub
through the standard cache (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN
for gated repos), fetching only what serving needs: configs, tokenizer files
and safetensors weights. Every failure is a `ModelSpecError` whose message is
one line naming the model, raised before anything starts.

Pickle weights (`.bin`, `.pt`, `.pth`) can run code when loaded, so a model
without safetensors weights is refused unless the caller allows pickle
(`--allow-pickle-weights`). Nothing here sets `trust_remote_code`: a model
whose config needs code of its own fails to load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# What serving reads from a checkpoint: configs (model, generation, tokenizer,
# the safetensors index), tokenizer files of every kind, chat templates.
SERVING_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab*", "*.jinja"]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]
PICKLE_HINT = "pickle weights can run code when loaded; --allow-pickle-weights loads them anyway"
# `org/name` or `name` (the Hub's own rules: letters, digits, - _ .), then `@revision`.
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+(?:@[\w./-]+)?$")


class ModelSpecError(ValueError):
    """A model that cannot be served as given (one line, naming it)."""


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # the local directory the services load
    repo_id: str | None = None  # None: given as a local directory
    revision: str | None = None  # the commit the repo id resolved to

    @property
    def spec(self) -> str:
        """The model pinned: the repo id at its commit (what another node
        resolves into its own cache), else the directory."""
        return f"{self.repo_id}@{self.revision}" if self.repo_id else self.path


@dataclass(frozen=True)
class ModelPair:
    target: ResolvedModel
    drafter: ResolvedModel | None


def resolve_pair(
    target: str, drafter: str | None, target_revision: str | None, drafter_revision: str | None, allow_pickle: bool
) -> ModelPair:
    """`--target` and `--drafter` (None: no drafter) with their revisions."""
    return ModelPair(
        resolve_model(target, target_revision, allow_pickle, "--target"),
        resolve_model(drafter, drafter_revision, allow_pickle, "--drafter") if drafter else None,
    )


def split_spec(spec: str, revision: str | None = None) -> tuple[str, str | None]:
    """`org/name@rev` -> (org/name, rev); an explicit revision wins over none
    in the spec, and the two must agree when both are given."""
    name, _, in_spec = spec.partition("@")
    if in_spec and revision and in_spec != revision:
        raise ModelSpecError(f"{spec}: revision {in_spec} in the name and {revision} given apart")
    return name, (revision or in_spec or None)


def looks_like_repo_id(spec: str) -> bool:
    """A spec that has a repo id's shape and names no local path (nor one in
    an existing directory, as a mistyped `models/targt` would)."""
    if spec.startswith((".", "/", "~")) or not _REPO_ID.match(spec):
        return False
    return not Path(spec).exists() and not ("/" in spec and Path(spec.split("/")[0]).is_dir())


def resolve_model(
    spec: str, revision: str | None = None, allow_pickle: bool = False, what: str = "model", weights: bool = True
) -> ResolvedModel:
    """The local directory of a model given as a directory or a repo id.
    what: how messages name it (e.g. "--target"); weights=False: only its
    configs and tokenizer (the orchestrator), unchecked weights."""
    if not looks_like_repo_id(spec):
        if revision:
            raise ModelSpecError(f"{what} {spec}: a revision applies to a Hugging Face repo id, not a directory")
        path = Path(spec).expanduser()
        check_model_dir(path, allow_pickle or not weights, f"{what} {spec}", weights)
        return ResolvedModel(str(path.resolve()))
    repo_id, rev = split_spec(spec, revision)
    label = f"{what} {repo_id}" + (f"@{rev}" if rev else "")
    patterns = SERVING_PATTERNS if weights else [p for p in SERVING_PATTERNS if p != "*.safetensors"]
    path = Path(_download(repo_id, rev, patterns, label))
    if weights and allow_pickle and not _weights(path, ("*.safetensors",)):
        path = Path(_download(repo_id, rev, SERVING_PATTERNS + PICKLE_PATTERNS, label))
    check_model_dir(path, allow_pickle, label, weights)
    return ResolvedModel(str(path), repo_id, path.name)


def model_label(model_dir: str) -> str:
    """What a replica reports as its model: `org/name@commit` for a snapshot
    of the Hugging Face cache (`.../models--org--name/snapshots/<commit>`),
    else the directory."""
    path = Path(model_dir)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        repo_id = path.parent.parent.name.removeprefix("models--").replace("--", "/")
        return f"{repo_id}@{path.name}"
    return model_dir


def check_model_dir(path: Path, allow_pickle: bool, label: str, weights: bool = True) -> None:
    """A Hugging Face model directory whose weights may be loaded (weights=False:
    any). One without weights passes: a cluster's head holds only the configs
    and tokenizers (deploy/cluster.yaml), and each replica checks its own copy."""
    if not path.is_dir():
        raise ModelSpecError(f"{label}: no such directory, and not a Hugging Face repo id (org/name)")
    if not (path / "config.json").exists():
        raise ModelSpecError(f"{label}: not a Hugging Face model directory (no config.json)")
    if not weights or _weights(path, ("*.safetensors",)):
        return
    pickled = _weights(path, tuple(PICKLE_PATTERNS))
    if pickled and not allow_pickle:
        raise ModelSpecError(f"{label}: only pickle weights ({pickled[0]}), no safetensors: {PICKLE_HINT}")


def _weights(path: Path, patterns: tuple[str, ...]) -> list[str]:
    return sorted(p.name for pattern in patterns for p in path.glob(pattern))


def _download(repo_id: str, revision: str | None, patterns: list[str], label: str) -> str:
    """snapshot_download of the patterns; its errors as one line each."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return str(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:  # before RepositoryNotFoundError: its subclass
        raise ModelSpecError(
            f"{label}: a gated repo; accept its terms on huggingface.co and set HF_TOKEN to a token that may read it"
        ) from None
    except RepositoryNotFoundError:
        raise ModelSpecError(
            f"{label}: no such repo on the Hugging Face Hub (or a private one: set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelSpecError(f"{label}: the repo has no revision {revision}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise ModelSpecError(f"{label}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}") from None
    except (HfHubHTTPError, OSError) as exc:
        text = " ".join(str(exc).split())
        raise ModelSpecError(f"{label}: {type(exc).__name__}: {text[:300]}") from None
