"""Every decoder form satisfies ``forms.DecoderForm`` (engine/model/forms.py): it has each member the
Protocol declares, its forward takes the Protocol's arguments, its flags are bools, and what a flag says it
can do, it does, on tiny random models on the CPU. A form that lacks a capability refuses it in one
``MaskError`` instead of computing something else."""
from __future__ import annotations

import inspect

import pytest
import torch

from knnssd.engine.model import tree_pass
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.forms import DecoderForm, Output
from knnssd.engine.model.hf_decoder import HFDecoder
from knnssd.engine.model.skip import MaskError, SkipMask
from knnssd.engine.model.weights import from_hf
from knnssd.engine.static.graphs import StaticDecoder
from knnssd.engine.static.slots import StaticSlots
from tiny import tiny

FLAGS = ("can_skip", "can_tree", "can_batch", "runs_ahead")


def _forms() -> dict[str, object]:
    model = tiny("llama")
    lean = Decoder(from_hf(model))
    return {
        "Decoder": lean,
        "Decoder.slot": lean.slot(),
        "Decoder.pooled_slots": lean.pooled_slots(2)[0][0],
        "HFDecoder": HFDecoder(model),
        "StaticDecoder": StaticDecoder(Decoder(from_hf(model)), length=512, graphs=False),
        "SlotView": StaticSlots(Decoder(from_hf(model)), slots=2, length=512, graphs=False).views[0],
    }


FORMS = _forms()


def _members() -> tuple[list[str], list[str]]:
    fields = [n for c in DecoderForm.__mro__ if c is not object for n in getattr(c, "__annotations__", {})]
    methods = [n for n, v in vars(DecoderForm).items() if inspect.isfunction(v) and not n.startswith("_")]
    return fields, methods


def test_the_protocol_declares_the_flags_and_the_methods_the_loops_call():
    fields, methods = _members()
    assert set(FLAGS) <= set(fields)
    assert {"forward", "reserve", "rollback", "int8_stack"} <= set(methods)


@pytest.mark.parametrize("name", list(FORMS))
def test_every_form_has_every_member_and_takes_the_protocols_arguments(name):
    form = FORMS[name]
    fields, methods = _members()
    missing = [n for n in fields + methods if not hasattr(form, n)]
    assert not missing, f"{name} lacks {missing}"
    assert all(type(getattr(form, f)) is bool for f in FLAGS), {f: getattr(form, f) for f in FLAGS}
    assert isinstance(form.n_layers, int) and form.n_layers > 0
    assert isinstance(form.device, torch.device)
    for m in methods:
        want = inspect.signature(getattr(DecoderForm, m)).parameters
        got = inspect.signature(getattr(form, m)).parameters
        assert list(got)[: len(want) - 1] == list(want)[1:], f"{name}.{m}{tuple(got)} is not {tuple(want)[1:]}"


@pytest.mark.parametrize("name", list(FORMS))
def test_every_form_runs_a_pass_and_does_what_its_flags_say(name):
    form = FORMS[name]
    ids = torch.arange(1, 9)
    form.reserve(32)
    out = form.forward(ids, 0)
    assert isinstance(out, Output) and out.logits.shape == (8, out.logits.shape[1])
    form.rollback(6)
    mask = SkipMask.from_layers(form.n_layers, attn=[0])
    if form.can_skip:
        assert form.forward(ids[6:7], 6, mask=mask).logits.shape[0] == 1
    else:
        with pytest.raises(MaskError):
            form.forward(ids[6:7], 6, mask=mask)
    if form.can_tree:
        logits, _ = tree_pass.forward_tree(form, ids[5:8], 5, (0, 0))
        assert logits.logits.shape[0] == 3
    if form.can_batch:
        slots, _pool = form.pooled_slots(2)
        assert form.slot() is not form and len(slots) == 2
    else:
        assert not hasattr(form, "pooled_slots")
