"""One config: every engine option reaches the EngineConfig the same way from a Serve config,
from `LLM(...)` keyword arguments and from CLI flags, and a bad value fails naming it."""

import argparse
import json

import pydantic
import pytest

from app.config import KV_DTYPES
from app.options import OPTIONS, add_engine_arguments, engine_config, flat_options, given_options
from app.serve.config import EngineArgs, ServeArgs

# A valid, non-default value for every option. Adding an option to app/config.py without
# adding it here fails test_every_option_has_a_test_value.
VALID = {
    "dtype": "bf16",
    "device": "cpu",
    "weight_quant": "int4",
    "fp8_activations": "w8a8",
    "attention_backend": "torch",
    "tensor_parallel_size": 2,
    "enable_expert_parallel": True,
    "seed": 7,
    "enforce_eager": True,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
    "block_size": 32,
    "kv_cache_dtype": "bf16",
    "kv_cache_memory_bytes": 12345678,
    "gpu_memory_utilization": 0.5,
    "cpu_kv_cache_bytes": 1 << 20,
    "enable_prefix_caching": False,
    "chunk_tokens": 512,
    "max_num_seqs": 3,
    "max_num_batched_tokens": 100,
    "max_waiting": 9,
    "long_prefill_chunk": 64,
    "light_load_step_tokens": 32,
    "decode_steps_after_prefill": 2,
    "prefill_chunk_for_decode_steps": 128,
}
INVALID = {
    "dtype": "float8",
    "weight_quant": "int3",
    "fp8_activations": "fp4",
    "attention_backend": "flash",
    "tensor_parallel_size": 0,
    "speculative_config": {"method": "telepathy"},
    "block_size": 0,
    "kv_cache_dtype": "fp4",
    "kv_cache_memory_bytes": -1,
    "gpu_memory_utilization": 1.5,
    "cpu_kv_cache_bytes": 0,
    "chunk_tokens": 100,  # not a multiple of block_size
    "max_num_seqs": 0,
    "max_num_batched_tokens": -5,
    "max_waiting": 0,
    "long_prefill_chunk": 0,
    "light_load_step_tokens": 0,
    "decode_steps_after_prefill": -1,
    "prefill_chunk_for_decode_steps": 0,
}


def same(got, want) -> bool:
    """Equal; a nested config (a dict) also carries the defaults of fields not given."""
    return got.items() >= want.items() if isinstance(want, dict) else got == want


def test_every_option_has_a_test_value():
    assert set(VALID) == set(OPTIONS) - {"model"}


@pytest.mark.parametrize("name", sorted(VALID))
def test_option_round_trips_from_a_serve_config(name):
    """Seen failing before EngineArgs was derived: enable_prefix_caching, attention_backend,
    long_prefill_chunk, max_waiting, gpu_memory_utilization (and more) were rejected as
    unknown fields, so operators could not set them."""
    value = VALID[name]
    engine = {name: value}
    if name == "block_size":
        engine["chunk_tokens"] = 256  # a multiple of 32
    cfg = ServeArgs(engine=engine).engine.engine_config("/models/m")
    assert same(flat_options(cfg)[name], value)


@pytest.mark.parametrize("name", sorted(VALID))
def test_option_round_trips_from_llm_kwargs_and_cli_flags(name):
    value = VALID[name]
    assert same(flat_options(engine_config({"model": "/m", name: value}))[name], value)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        argv = [flag if value else "--no-" + name.replace("_", "-")]
    else:
        argv = [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    assert given_options(parser.parse_args(argv)) == {name: value}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_bad_value_fails_at_validation_naming_the_field(name):
    with pytest.raises(pydantic.ValidationError) as e:
        EngineArgs(**{name: INVALID[name]})
    message = str(e.value)
    named = name if name != "speculative_config" else "speculative method"
    assert named in message, message
    with pytest.raises(ValueError, match=named):  # LLM(...) and the CLIs: the same check
        engine_config({"model": "/m", name: INVALID[name]})


def test_unknown_options_are_rejected_everywhere():
    with pytest.raises(pydantic.ValidationError, match="max_num_seq"):
        ServeArgs(engine={"max_num_seq": 4})  # typo
    with pytest.raises(TypeError, match="max_num_seq"):
        engine_config({"model": "/m", "max_num_seq": 4})


def test_kv_cache_dtype_choices_come_from_one_place():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, ["kv_cache_dtype"])
    (action,) = [a for a in parser._actions if a.dest == "kv_cache_dtype"]
    assert tuple(action.choices) == KV_DTYPES == OPTIONS["kv_cache_dtype"].choices
    schema = EngineArgs.model_json_schema()["properties"]["kv_cache_dtype"]
    assert tuple(schema["enum"]) == KV_DTYPES


def test_unset_flags_leave_the_config_file_alone():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert given_options(parser.parse_args([])) == {}


def test_kv_dtype_names_follow_the_kv_table():
    """app/config.py spells the KV table's names out (the table needs torch, the config must
    not); a dtype added to app/kv/dtypes.py without its config name fails here."""
    from app.config import KV_DTYPES
    from app.kv.dtypes import CONFIG_NAMES

    assert KV_DTYPES == CONFIG_NAMES
