from pathlib import Path

import pytest
import yaml

from tokenmill_runner.spec.resource import SpecError, load_spec_file, parse_document

MINIMAL = {
    "apiVersion": "tokenmill.io/v1alpha1",
    "kind": "DatasetGeneration",
    "metadata": {"name": "t"},
    "spec": {
        "model": {"path": "/models/m"},
        "sampling": {"temperature": "0.6", "maxNewTokens": 1000},
        "datasets": [{"name": "a", "source": "/p/a.jsonl", "sampling": {"maxNewTokens": 32768, "topK": 20}},
                     {"name": "b", "source": "/p/b.jsonl"}],
        "output": {"uri": "s3://bucket/run/"},
    },
}


def doc(**spec_updates):
    document = yaml.safe_load(yaml.safe_dump(MINIMAL))
    document["spec"].update(spec_updates)
    return document


def test_dataset_sampling_overrides_defaults():
    spec = parse_document(doc()).spec
    a, b = spec.datasets
    assert spec.sampling_for(a).to_sglang() == {"max_new_tokens": 32768, "temperature": 0.6, "top_k": 20}
    assert spec.sampling_for(b).to_sglang() == {"max_new_tokens": 1000, "temperature": 0.6}


def test_default_max_new_tokens_is_not_sglangs_128():
    document = doc(sampling={})
    spec = parse_document(document).spec
    assert spec.sampling_for(spec.datasets[1]).max_new_tokens == 10240


@pytest.mark.parametrize(
    ("update", "fragment"),
    [
        ({"datasets": [{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]}, "used twice"),
        ({"sampling": {"maxNewTokens": 0}}, "spec.sampling.maxNewTokens"),
        ({"sampling": {"maxNewTokens": None}}, "spec.sampling.maxNewTokens"),
        ({"sampling": {"temperature": "warm"}}, "spec.sampling.temperature"),
        ({"validation": {"maxTruncatedFraction": "1.5"}}, "spec.validation.maxTruncatedFraction"),
        ({"output": {"uri": "gs://bucket/x"}}, "spec.output.uri"),
        ({"datasets": [{"name": "bad name!", "source": "x"}]}, "spec.datasets[0].name"),
        ({"datasets": [{"name": "a", "source": "x", "limt": 5}]}, "spec.datasets[0].limt"),
        ({"datasets": []}, "spec.datasets"),
        # What the SGLang release in use would refuse is refused here, naming the field (docs/sglang-release-facts.md
        # §C.1: nvfp4 from 0.5.16; fp4_e2m1 gone in 0.5.21).
        ({"server": {"image": "lmsysorg/sglang:v0.5.9", "kvCacheDtype": "nvfp4"}}, "spec.server"),
        ({"server": {"image": "lmsysorg/sglang:v0.5.23", "kvCacheDtype": "fp4_e2m1"}}, "SGLang 0.5.23"),
        ({"server": {"kvCacheDtype": "fp16"}}, "spec.server.kvCacheDtype"),
        ({"server": {"sglangVersion": "0.4.1"}}, "spec.server.sglangVersion"),
        ({"server": {"nodes": 0}}, "spec.server.nodes"),
        ({"server": {"replicas": -1}}, "spec.server.replicas"),
        ({"datasets": [{"name": "a", "source": "x", "samples": 0}]}, "spec.datasets[0].samples"),
        ({"datasets": [{"name": "a", "source": "x", "samples": 65}]}, "spec.datasets[0].samples"),
        ({"datasets": [{"name": "a", "source": "x", "input": {"format": "alpaca"}}]}, "spec.datasets[0].input.format"),
        ({"datasets": [{"name": "a", "source": "x", "input": {"fields": {"prompt_col": "q"}}}]},
         "spec.datasets[0].input.fields.prompt_col"),
        ({"seed": -1}, "spec.seed"),
        # SpecForge 0.2.0 reads .ckpt tensors as stored: no reader of fp8 states.
        ({"hiddenStates": {"storage": "fp8", "layouts": ["specforge"]}}, "no FP8 reader"),
        ({"hiddenStates": {"storage": "int4"}}, "spec.hiddenStates.storage"),
    ],
)
def test_bad_specs_name_the_field(update, fragment):
    with pytest.raises(SpecError) as error:
        parse_document(doc(**update), "my.yaml")
    assert fragment in str(error.value)
    assert "my.yaml" in str(error.value)


def test_a_bare_number_is_refused_as_the_crd_refuses_it():
    """One schema for tokenmill run and kubectl apply: the CRD types decimals as strings (crds/, `type: string`), so
    the CLI refuses `temperature: 0.6` too, naming the field and the quoted value to write (fails on f9665d2, which
    turned the number into a string that the cluster path then refused)."""
    with pytest.raises(SpecError) as error:
        parse_document(doc(sampling={"temperature": 0.7, "topP": 1}), "my.yaml")
    assert 'spec.sampling.temperature: Value error, write the number as a quoted string, "0.7"' in str(error.value)
    assert "spec.sampling.topP" in str(error.value)
    with pytest.raises(SpecError, match="spec.validation.maxTruncatedFraction"):
        parse_document(doc(validation={"maxTruncatedFraction": 0.05}))
    spec = parse_document(doc(sampling={"temperature": "0.7", "topP": "1"})).spec
    assert spec.sampling.temperature == "0.7" and spec.sampling.top_p == "1"


def test_relative_paths_resolve_against_the_spec_folder(tmp_path: Path):
    document = doc(model={"path": "./model"}, output={"uri": "../out"},
                   datasets=[{"name": "a", "source": "prompts/a.jsonl"}])
    folder = tmp_path / "examples"
    folder.mkdir()
    (folder / "spec.yaml").write_text(yaml.safe_dump(document))
    spec = load_spec_file(folder / "spec.yaml").spec
    assert spec.model.path == str(folder / "model")
    assert spec.datasets[0].source == str(folder / "prompts" / "a.jsonl")
    assert spec.output.uri == str(tmp_path / "out")


def test_hub_ids_stay_hub_ids(tmp_path: Path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc(model={"path": "moonshotai/Kimi-K2.5"})))
    assert load_spec_file(tmp_path / "s.yaml").spec.model.path == "moonshotai/Kimi-K2.5"


def test_examples_parse():
    repo = Path(__file__).resolve().parents[2]
    for path in sorted((repo / "examples").glob("*.yaml")):
        load_spec_file(path)


def test_auto_concurrency_fills_the_servers_and_keeps_a_queue():
    from tokenmill_runner.facts.server_info import ServerFacts
    from tokenmill_runner.prepare import resolve_concurrency
    from tokenmill_runner.spec.config import RunnerConfig

    def server(slots, kv_tokens):
        # /server_info of 0.5.9+: effective_max_running_requests_per_dp and the KV pool per DP scheduler.
        return ServerFacts.read("http://a", {"version": "0.5.23", "max_total_num_tokens": kv_tokens, "internal_states": [
            {"effective_max_running_requests_per_dp": slots, "memory_usage": {"token_capacity": kv_tokens}}]})

    spec = parse_document(doc()).spec  # longest cap 32768 -> typical request 512 + 0.15 * 32768 = 5427 tokens
    one = RunnerConfig(spec=spec, servers=["http://a"], output_uri="/tmp/x")
    kv_bound = server(2048, 868_000)
    assert resolve_concurrency(one, [kv_bound]) == int(159 * 1.5) + 64  # 868000 // 5427 = 159 requests fit
    slot_bound = server(100, 10_000_000)
    two = RunnerConfig(spec=spec, servers=["http://a", "http://b"], output_uri="/tmp/x")
    assert resolve_concurrency(two, [slot_bound, slot_bound]) == 364
    assert resolve_concurrency(two, [slot_bound]) == 364, "a replica down at the start counts like the other"
    four = RunnerConfig(spec=spec, servers=["http://a"], output_uri="/tmp/x", worker_count=4)
    assert resolve_concurrency(four, [slot_bound]) == 54  # ceil(214 / 4)
    # DP attention: each of the 8 groups has its own pool; /server_info reports one group's (--attn-dp-size from
    # 0.5.22, --dp-size with --enable-dp-attention before; --dp-size alone runs 8 replicas, each with its pool).
    for dp in ({"attn_dp_size": 8, "dp_size": 1}, {"dp_size": 8, "enable_dp_attention": True}, {"dp_size": 8}):
        info = {"version": "0.5.23", "max_total_num_tokens": 868_000, "max_running_requests": 16384, **dp}
        assert resolve_concurrency(one, [ServerFacts.read("http://a", info)]) == int(8 * 159 * 1.5) + 64
    fixed = spec.model_copy(update={"runner": spec.runner.model_copy(update={"concurrency": 7})})
    assert resolve_concurrency(RunnerConfig(spec=fixed, servers=["http://a"], output_uri="/tmp/x"), [kv_bound]) == 7


def test_datasets_run_longest_expected_first():
    from tokenmill_runner.generate.pipeline import DatasetState
    from tokenmill_runner.store.ledger import DatasetLedger
    from tokenmill_runner.store.shards import ShardBuffer

    spec = parse_document(doc()).spec

    def state(index: int, rows: int = 0, tokens: int = 0) -> DatasetState:
        dataset = spec.datasets[index]
        ledger = DatasetLedger(dataset.name, 100)
        ledger.fold({"shard_id": "w000-a-000001", "failed": {"line": [], "reason": []}, "samples": {
            "line": list(range(1, rows + 1)), "completion_tokens": [tokens // rows if rows else 0] * rows}})
        return DatasetState(spec=dataset, index=index, sampling=spec.sampling_for(dataset), ledger=ledger,
                            buffer=ShardBuffer(1, 1), slots=10)

    assert state(0).mean_output_expected() == 0.15 * 32768  # nothing seen yet: a share of the cap
    assert state(1).mean_output_expected() == 0.15 * 1000
    assert state(1, rows=40, tokens=40 * 9000).mean_output_expected() == 9000  # what was committed wins


@pytest.mark.parametrize("arg", ["--api-ke=known-key", "--hos=127.0.0.1", "--trust-remote-code", "--config",
                                 "--tp=2", "--model", "--admin-api-key=x"])
def test_extra_args_may_not_set_or_abbreviate_a_managed_flag(arg):
    """SGLang's argparse takes any unambiguous abbreviation (0.5.23 server_args.py:679): --api-ke sets --api-key."""
    from pydantic import ValidationError

    from tokenmill_runner.spec.resource import ServerSpec

    with pytest.raises(ValidationError, match="which the operator manages"):
        ServerSpec.model_validate({"extraArgs": ["--chunked-prefill-size", "4096", arg]})
    assert ServerSpec.model_validate({"extraArgs": ["--chunked-prefill-size", "4096", "--enable-metrics"]})


@pytest.mark.parametrize("uri", ["s3://b/runs/a/../../escaped/", "s3://b/runs/b%2F..%2Fc/", "s3://b/./x/",
                                 "s3://b/runs\\x/",
                                 # accepted on a87e82b (security-a87e82b.md W14): '..' once decoded, an empty segment
                                 "s3://b/runs/%2e%2e/x/", "s3://b/runs/%2E%2E/x/", "s3://b/runs//x/", "s3://b//x/"])
def test_an_s3_output_prefix_cannot_name_a_way_out_of_itself(uri):
    from pydantic import ValidationError

    from tokenmill_runner.spec.resource import OutputSpec

    with pytest.raises(ValidationError, match="could leave the prefix"):
        OutputSpec.model_validate({"uri": uri})
    assert OutputSpec.model_validate({"uri": "s3://b/runs/v1..v2/x.y/"})
    assert OutputSpec.model_validate({"uri": "s3://b/"}) and OutputSpec.model_validate({"uri": "s3://b"})
    assert OutputSpec.model_validate({"uri": "../out/demo"}), "a local folder relative to the spec stays allowed"
