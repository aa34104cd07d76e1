"""The exporter's translation table made once per process (ortrain/exporter_registry.py)."""

from __future__ import annotations

from torch.onnx._internal.exporter import _registration

from ortrain import exporter_registry
from ortrain.export_aten import complex_translations


def test_each_export_gets_its_own_copy_of_one_table():
    exporter_registry.warm()
    with exporter_registry.cached_registry():
        first = _registration.ONNXRegistry.from_torchlib()
        target = next(iter(first.functions))
        first.functions[target].append("registered by one export")
        second = _registration.ONNXRegistry.from_torchlib()
    assert second is not first and second.functions is not first.functions
    assert "registered by one export" not in second.functions[target]
    assert second.functions.keys() == first.functions.keys()
    assert second.opset_version == first.opset_version


def test_the_exporters_own_constructor_is_back_after_an_export():
    before = _registration.ONNXRegistry.__dict__["from_torchlib"]
    with exporter_registry.cached_registry():
        assert _registration.ONNXRegistry.__dict__["from_torchlib"] is not before
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is before
    fresh = _registration.ONNXRegistry.from_torchlib()  # the exporter's, made anew
    with exporter_registry.cached_registry():
        cached = _registration.ONNXRegistry.from_torchlib()
    assert fresh.functions.keys() == cached.functions.keys()
    # the same entries, and first for each complex translation ortrain adds (export_aten)
    added = complex_translations()
    seen = []
    for k in fresh.functions:
        ours = [m for m in cached.functions[k] if m.onnx_function in added.values()]
        assert [(m.is_complex, m.is_custom) for m in ours] == [(True, True)] * len(ours)
        assert all(added[m.fx_target] is m.onnx_function for m in ours)
        assert cached.functions[k][len(ours) :] == fresh.functions[k] or len(ours) == 0
        assert len(cached.functions[k]) == len(fresh.functions[k]) + len(ours)
        seen += [m.fx_target for m in ours]
    assert sorted(map(str, seen)) == sorted(map(str, added))


def test_the_table_is_the_exporters_entry_for_entry():
    """Made without compiling every function's IR, the table holds the exporter's own
    entries: the same targets, and per target the same functions in the same order, with
    the same flags."""
    fresh = _registration.ONNXRegistry.from_torchlib()  # the exporter's, made anew
    ours = exporter_registry._unparsed_table(_registration, fresh.opset_version)
    assert list(ours.functions) == list(fresh.functions)
    for target, metas in fresh.functions.items():
        got = ours.functions[target]
        want = [(m.onnx_function, m.is_complex, m.is_custom, m.fx_target) for m in metas]
        assert [(m.onnx_function, m.is_complex, m.is_custom, m.fx_target) for m in got] == want


def test_no_function_ir_is_compiled_to_make_the_table(monkeypatch):
    """What the table saves: the exporter's constructor compiles the ONNX IR of every
    traced torchlib function from its source (``TracedOnnxFunction.function_ir``, not
    kept); ours none."""
    from onnxscript._internal import values

    compiled = []
    real = values.TracedOnnxFunction.function_ir

    def counting(self):
        compiled.append(self.name)
        return real.fget(self)

    monkeypatch.setattr(values.TracedOnnxFunction, "function_ir", property(counting))
    exporter_registry._unparsed_table(_registration, 18)
    assert compiled == []
    _registration.ONNXRegistry.from_torchlib()
    assert len(compiled) > 100


def test_operator_registrations_reuse_one_alias_and_torch_gets_its_own_back():
    """``py_impl``'s decorator annotations are made once per subscript inside the context
    (module docstring); ``isinstance`` against torch's ``Callable`` answers as before, and
    torch's own ``Callable`` is back after it."""
    import collections.abc
    import typing

    import torch
    import torch._ops as ops

    p, t = typing.ParamSpec("P"), typing.TypeVar("T")
    with exporter_registry.cached_registry():
        assert ops.Callable is not collections.abc.Callable
        assert ops.Callable[p, t] is ops.Callable[p, t]
        assert ops.Callable[p, t] == collections.abc.Callable[p, t]
        unhashable = ops.Callable[[int], str]  # an argument list: made each time, still right
        assert unhashable == collections.abc.Callable[[int], str]
        assert isinstance(len, ops.Callable) and not isinstance(3, ops.Callable)
        assert issubclass(type(len), ops.Callable) and not issubclass(int, ops.Callable)
        op = torch.ops.aten.sin.default
        key = torch._C.DispatchKey.AutogradCPU
        saved = op.py_kernels.copy()
        decorate = op.py_impl(key)
        try:
            fn = decorate(lambda *a, **k: None)
            assert op.py_kernels[key] is fn
            annotations = decorate.__annotations__
            assert annotations["fn"] is annotations["return"] is ops.Callable[ops._P, ops._T]
        finally:
            op.py_kernels.clear()
            op.py_kernels.update(saved)
            op._dispatch_cache.clear()
    assert ops.Callable is collections.abc.Callable
