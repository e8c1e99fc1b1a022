"""A bad speculative config is refused at start with a
message naming the key - as a file, as flags, and by `specd up`."""
import os
import subprocess
import sys

import pytest

from orchestrator.spec_config import ConfigError, SpeculativeConfig, load

BAD = [
    ({"method": "lookahead"}, "speculative_config.method"),
    ({"num_speculative_tokens": -1}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"lookahead": 3}, "speculative_config.lookahead: unknown key"),
    ({"tree": {"branching": [2, 0]}}, "speculative_config.tree"),
    ({"tree": {"width": 3}}, "speculative_config.tree.width: unknown key"),
    ({"method": "ngram", "tree": {"branching": [2]}}, "speculative_config.tree"),
    ({"num_speculative_tokens": "four"}, "speculative_config.num_speculative_tokens"),
    ({"pipeline": "sometimes"}, "speculative_config.pipeline"),
]


@pytest.mark.parametrize("data,needle", BAD, ids=[n for _, n in BAD])
@pytest.mark.unit
def test_bad_config_names_the_key(data, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        SpeculativeConfig.from_dict(data)


@pytest.mark.unit
def test_yaml_and_toml_files(tmp_path):
    y = tmp_path / "spec.yaml"
    y.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 5\n  prompt_lookup_max: 3\n")
    assert load(y) == SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_max=3)
    t = tmp_path / "spec.toml"
    t.write_text('method = "draft_model"\nnum_speculative_tokens = 3\n[tree]\nbranching = [2, 1]\n')
    c = load(t)
    assert c.tree_shape().branching == (2, 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: ngram\nprompt_lookup_min: 4\nprompt_lookup_max: 2\n")
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        load(bad)


@pytest.mark.services
def test_specd_up_refuses_a_bad_config_before_starting_anything(tmp_path, pairs):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: draft_model\nnum_speculative_tokens: 4\nprompt_lookup_mx: 3\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["SPECD_HOME"] = str(tmp_path / "home")
    target, drafter = pairs["llama"]
    r = subprocess.run([sys.executable, "-m", "specd", "up", "--target", target, "--drafter", drafter,
                        "--speculative-config", str(bad)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "speculative_config.prompt_lookup_mx: unknown key" in r.stderr
    assert "started a local Ray cluster" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "specd", "up", "--target", target, "--method", "ngram",
                        "--prompt-lookup-min", "6"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "prompt_lookup_min (6) is greater than prompt_lookup_max (4)" in r.stderr


@pytest.mark.unit
def test_tree_paths_in_config_and_flags():
    """A static tree node by node: a deep chain plus the second choice at depth 1."""
    from orchestrator.spec_config import speculative_config_from_args
    from specd.cli import build_parser
    sc = SpeculativeConfig.from_dict({"tree": {"paths": [[0], [1], [0, 0], [0, 0, 0]]}})
    shape = sc.tree_shape()
    assert shape.max_nodes == 4 and shape.depth == 3
    assert shape.children() == {(): 2, (0,): 1, (0, 0): 1}
    args = build_parser().parse_args(["up", "--tree-paths", "0;1;0,0;0,0,0"])
    assert speculative_config_from_args(args).tree_shape() == shape
    for bad, needle in [([[0], [0, 1]], "elder sibling"), ([[0, 0]], "before its parent"),
                        ([[0], [0]], "listed twice"), ([[0], []], "non-empty"), ([[0], "ab"], "speculative_config.tree")]:
        with pytest.raises(ConfigError, match=needle):
            SpeculativeConfig.from_dict({"tree": {"paths": bad}})


@pytest.mark.unit
def test_pipeline_settings_and_who_gets_pipelined():
    """pipeline: auto (the default), on or off, as a file key or flags; with
    auto, greedy and unseeded draft_model chains pipeline while alone on their
    drafter, a seeded sampled request never (its output must not depend on
    the load); a request's own pipeline_drafting pipelines every cycle."""
    from orchestrator.edge.request import InvalidRequest, pipelining
    from orchestrator.spec_config import speculative_config_from_args
    from specd.cli import build_parser
    from specd_core.api.v1 import specdec_pb2 as pb
    from specd_core.rules.draft_shape import DraftShape

    assert SpeculativeConfig().pipeline == "auto"
    for flags, want in [([], "auto"), (["--pipeline"], True), (["--pipeline", "auto"], "auto"),
                        (["--pipeline", "off"], False), (["--no-pipeline"], False), (["--pipeline", "on"], True)]:
        args = build_parser().parse_args(["up", "--target", "t", *flags])
        assert speculative_config_from_args(args).pipeline == want, flags
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--target", "t", "--pipeline", "maybe"])
    assert SpeculativeConfig.from_dict({"pipeline": True}).pipeline is True
    from specd.cli.client import generate_request
    for flags, want in [([], None), (["--pipeline"], True), (["--no-pipeline"], False), (["--pipeline", "auto"], None)]:
        req = generate_request(build_parser().parse_args(["generate", "hi", *flags]))
        assert (req.pipeline_drafting if req.HasField("pipeline_drafting") else None) == want, flags

    chain, tree = DraftShape.chain(4), DraftShape(branching=(2, 1))
    auto, on, off = SpeculativeConfig(), SpeculativeConfig(pipeline=True), SpeculativeConfig(pipeline=False)
    greedy, unseeded = pb.GenerateRequest(), pb.GenerateRequest(temperature=0.8)
    seeded, seeded_greedy = pb.GenerateRequest(temperature=0.8, seed=3), pb.GenerateRequest(seed=3)
    assert pipelining(greedy, auto, "draft_model", chain) == (True, True)
    assert pipelining(unseeded, auto, "draft_model", chain) == (True, True)
    assert pipelining(seeded_greedy, auto, "draft_model", chain) == (True, True)
    assert pipelining(seeded, auto, "draft_model", chain)[0] is False
    assert pipelining(greedy, auto, "draft_model", tree)[0] is False
    assert pipelining(greedy, auto, "eagle", chain)[0] is False
    assert pipelining(greedy, auto, "draft_model", chain, constrained=True)[0] is False
    assert pipelining(seeded, on, "draft_model", chain) == (True, False)
    assert pipelining(greedy, off, "draft_model", chain) == (False, False)
    asked = pb.GenerateRequest(temperature=0.8, seed=3, pipeline_drafting=True)
    assert pipelining(asked, auto, "draft_model", chain) == (True, False)
    assert pipelining(pb.GenerateRequest(pipeline_drafting=False), on, "draft_model", chain) == (False, False)
    with pytest.raises(InvalidRequest, match="draft_model"):
        pipelining(asked, auto, "draft_model", tree)
