"""The decoding session: what generate() keeps between calls lives in one object on the model, a
reset makes the next call plan as the first did, and no runtime module keeps state of its own."""

import importlib
import pkgutil
import weakref
from types import SimpleNamespace

import torch
from helpers import cycle_batch

import tidar_convert.runtime as runtime
from tidar_convert.runtime import engine
from tidar_convert.runtime.generate import generate
from tidar_convert.runtime.session import Session, reset, session_of


def steady_clock():
    """Every step seems to take as long as its query slots: the cost plan's prices repeat."""
    now = [0.0]

    def perf_counter():
        now[0] += 0.01
        return now[0]

    return perf_counter


def decode_once(model, monkeypatch, ids):
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=steady_clock()))
    out = generate(ids, model=model, max_new_tokens=24, eos_token_id=None, plan="cost")
    return out, (model.tidar_stats["accepted"], model.tidar_stats["slots_per_step"])


def test_generate_keeps_its_state_in_the_models_session_and_reset_forgets_it(trained, monkeypatch):
    model, _ = trained["llama"]
    reset(model)
    ids = cycle_batch(1, 7, seed=3)
    first, first_steps = decode_once(model, monkeypatch, ids)
    session = model.tidar_session
    assert isinstance(session, Session) and session is session_of(model)
    assert session.costs and all(t.steps > 0 for t in session.costs.values())
    assert session.own_masks  # the plans' mask blocks, kept for the next steps
    assert "tidar_session" not in dict(model.named_modules())  # not a submodule: not saved
    assert "tidar_session" not in str(model.state_dict().keys())

    again, _ = decode_once(model, monkeypatch, ids)
    assert model.tidar_session is session and torch.equal(again, first)

    reset(model)
    assert session.costs == {} and session.own_masks == {} and session.kernels.timing is None
    fresh, fresh_steps = decode_once(model, monkeypatch, ids)
    # as the first call on this model: the same tokens, and the same steps from the same prices
    assert torch.equal(fresh, first) and fresh_steps == first_steps


def test_a_copied_or_pickled_model_starts_a_session_of_its_own(untrained):
    import copy
    import pickle

    from tidar_convert.runtime import kernels

    model = untrained["llama"]
    generate(cycle_batch(1, 6, seed=2), model=model, max_new_tokens=6, pack_weights=True)
    session = model.tidar_session
    assert session.costs and (session.kernels.packed or not kernels.can_pack())
    twin = copy.deepcopy(model)
    assert twin.tidar_session is not session and twin.tidar_session.costs == {}
    assert pickle.loads(pickle.dumps(session)).costs == {}
    assert model.tidar_session is session and session.costs  # the original keeps its own


def test_no_runtime_module_keeps_state_of_its_own(trained):
    """Every module-level container of runtime/ is as large after decoding as before: caches of
    masks, kernel choices or packed weights belong to the model's session."""
    modules = [
        importlib.import_module(f"tidar_convert.runtime.{m.name}")
        for m in pkgutil.iter_modules(runtime.__path__)
    ]
    containers = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)

    def sizes():
        return {
            (module.__name__, name): len(value)
            for module in modules
            for name, value in vars(module).items()
            if isinstance(value, containers) and not name.startswith("__")
        }

    before = sizes()
    model, _ = trained["qwen2"]
    ids = cycle_batch(2, 6, seed=1)
    generate(ids, model=model, max_new_tokens=12, eos_token_id=None)
    generate(ids[:1], model=model, max_new_tokens=12, eos_token_id=None, siblings=3)
    grown = {key: (n, sizes()[key]) for key, n in before.items() if sizes()[key] != n}
    assert not grown, f"module-level state grew while decoding: {grown}"
