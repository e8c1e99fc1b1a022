"""A Hugging Face cache built by hand, as huggingface_hub lays it out
(`hub/models--org--name/snapshots/<commit>/...`, `refs/<branch>` holding a
commit), from local model directories: the hub tests run offline
(HF_HUB_OFFLINE=1) against it, so nothing is downloaded."""

import shutil
from pathlib import Path


def add_snapshot(hf_home: Path, repo_id: str, commit: str, model_dir: Path, refs=("main",), skip=()) -> Path:
    """Copy `model_dir` (less files named in `skip`) in as `repo_id` at `commit`,
    which each of `refs` points at; the snapshot directory."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name not in skip:
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def offline_env(hf_home: Path) -> dict:
    """The environment a process needs to resolve repo ids from this cache only."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
