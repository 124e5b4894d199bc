"""log_completions_hub_repo: the completion logs reach a Hub dataset repo. No Hub here: the two calls that go over
the network (HfApi.create_repo, HfApi.create_commit) are replaced by a recording stand-in; huggingface_hub's own
CommitScheduler decides what each commit carries."""

import io

import pyarrow.parquet as pq
import pytest
from helpers import distinct_tokens, numbered_prompts, quiet_config
from huggingface_hub import CommitInfo, HfApi, RepoUrl

from grouprl import GRPOTrainer


class RecordingHub:
    """What the Hub would have received: created repos, and each commit's files (path -> bytes)."""

    def __init__(self, fail: bool = False):
        self.repos, self.commits, self.fail = [], [], fail

    def create_repo(self, api, repo_id, *, repo_type=None, private=None, exist_ok=False, **kwargs):
        if self.fail:
            raise PermissionError("401 Unauthorized: invalid token")
        self.repos.append((repo_id, repo_type, private))
        return RepoUrl(f"https://huggingface.co/datasets/{repo_id}")

    def create_commit(self, api, repo_id, operations, *, commit_message, repo_type=None, **kwargs):
        files = {}
        for operation in operations:
            with operation.as_file() as handle:
                files[operation.path_in_repo] = handle.read()
        self.commits.append({"repo": repo_id, "type": repo_type, "files": files})
        return CommitInfo(
            commit_url=f"https://huggingface.co/datasets/{repo_id}/commit/{len(self.commits)}",
            commit_message=commit_message,
            commit_description="",
            oid=f"{len(self.commits):040d}",
        )


@pytest.fixture
def hub(monkeypatch):
    recording = RecordingHub()
    monkeypatch.setattr(HfApi, "create_repo", lambda api, *a, **k: recording.create_repo(api, *a, **k))
    monkeypatch.setattr(HfApi, "create_commit", lambda api, *a, **k: recording.create_commit(api, *a, **k))
    return recording


def config(tmp_path, **overrides):
    return quiet_config(
        tmp_path,
        {"log_completions": True, "log_completions_hub_repo": "me/completions", **overrides},
        per_device_train_batch_size=3,
        max_completion_length=4,
        max_steps=2,
        bf16=False,
        num_completions_to_print=0,
    )


def test_every_logged_step_reaches_the_dataset_repo_by_the_end_of_training(tiny_model_dir, tmp_path, hub):
    """A private dataset repo is created with a card; by the time train() returns, the Hub has each step's parquet
    file, byte for byte as written in output_dir/completions."""
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config(tmp_path, hub_private_repo=True),
        train_dataset=numbered_prompts(6),
    )
    assert hub.repos[0] == ("me/completions", "dataset", True)
    trainer.train()
    uploaded = {}
    for commit in hub.commits:
        assert commit["repo"] == "me/completions" and commit["type"] == "dataset"
        uploaded.update(commit["files"])
    folder = tmp_path / "out" / "completions"
    written = sorted(p.name for p in folder.glob("*.parquet"))
    assert written == ["completions_00001.parquet", "completions_00002.parquet"]
    assert set(uploaded) == {"README.md", *written}
    assert b"Completion logs of a GRPO run" in uploaded["README.md"]
    for name in written:
        assert uploaded[name] == (folder / name).read_bytes()
    table = pq.read_table(io.BytesIO(uploaded["completions_00002.parquet"])).to_pydict()
    assert set(table["step"]) == {2} and len(table["completion"]) == 3  # one generation: 1 prompt x G=3


def test_a_hub_that_refuses_stops_the_trainer_before_training_with_the_way_out(tiny_model_dir, tmp_path, monkeypatch):
    recording = RecordingHub(fail=True)
    monkeypatch.setattr(HfApi, "create_repo", lambda api, *a, **k: recording.create_repo(api, *a, **k))
    with pytest.raises(RuntimeError, match=r"log_completions_hub_repo='me/completions'.*401 Unauthorized.*hf auth"):
        GRPOTrainer(
            tiny_model_dir, reward_funcs=distinct_tokens, args=config(tmp_path), train_dataset=numbered_prompts(6)
        )
