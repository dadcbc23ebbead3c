"""A request's settings (``engine/spec/request_params.py``): generation parameters, prompts and
limits, each refused in one line."""
import math

import pytest

from knnssd.engine.spec.request_params import GenerateParams, Limits, check_prompt
from knnssd.engine.spec.sampling import Warp


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0),
    ("top_k", math.nan), ("max_new_tokens", 0), ("max_new_tokens", -5), ("max_new_tokens", math.nan),
    ("max_new_tokens", "8"), ("seed", 1.5), ("seed", 2**70), ("seed", -2), ("temperature", 1e-300), ("temperature", 1e-7),
])
def test_bad_generation_parameters_are_one_line_errors(field, value):
    with pytest.raises(ValueError) as e:
        GenerateParams.from_dict({field: value})
    assert "\n" not in str(e.value) and field.split("_")[0] in str(e.value)


def test_good_generation_parameters_pass():
    p = GenerateParams.from_dict({"max_new_tokens": 8.0, "temperature": 0.7, "top_p": 0.9, "seed": -1})
    assert p.max_new_tokens == 8 and p.seed is None and p.warp == Warp(0.7, 0, 0.9)


@pytest.mark.parametrize("prompt,message", [
    ("caf\udce9", "not valid UTF-8"), ("   ", "empty prompt"), (None, "must be text, got null"),
    (math.nan, "must be text, got null"), (3, "must be text, got int"),
])
def test_bad_prompts_are_one_line_errors(prompt, message):
    with pytest.raises(ValueError, match=message):
        check_prompt(prompt)


def test_limits_are_the_model_context_and_the_kv_budget():
    """Defects 5 and 7: a billion new tokens tried to allocate 384 GB after the model loaded, and a 44k-token
    prompt ran for minutes on a model of 8,192 positions."""
    lim = Limits(context=8192, kv_bytes=23040)
    assert lim.positions == 8192
    with pytest.raises(ValueError, match=r"max_new_tokens \(1000000000\) must be below the model's context of 8192"):
        lim.check(GenerateParams(max_new_tokens=10**9))
    assert lim.prompt_tokens(GenerateParams(max_new_tokens=8, max_prompt_tokens=100_000)) == 8184
    assert lim.prompt_tokens(GenerateParams(max_new_tokens=8, max_prompt_tokens=100)) == 100
    big = Limits(context=1 << 20, kv_bytes=1 << 20, memory=1 << 30)  # 1 MiB a position: 1,024 fit the budget
    with pytest.raises(ValueError, match=r"below the 1 GiB KV-cache budget of one sequence \(1024 positions\)"):
        big.check(GenerateParams(max_new_tokens=1024))
