"""The binding's type hints (PEP 561): every public function, method and
property is annotated, parameters and return, so that the hints cannot rot
silently when the API grows.  Needs no library (nothing is called)."""

import inspect
import os
import sys
import typing

import pytest

import meshlm
from meshlm import tools


def _public_callables():
    """(qualified name, function) of the public API: meshlm.__all__'s
    functions and classes (their __init__), meshlm.tools.__all__'s, and
    every public method and property of Policy and MeshlmError (with
    __init__, __enter__, __exit__)."""
    out = []
    for mod, names in ((meshlm, meshlm.__all__), (tools, tools.__all__)):
        for name in names:
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                out.append(("%s.%s" % (mod.__name__, name), obj))
    for cls in (meshlm.Policy, meshlm.MeshlmError):
        for name, member in vars(cls).items():
            if name.startswith("_") and name not in ("__init__", "__enter__", "__exit__"):
                continue
            if isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member):
                out.append(("%s.%s" % (cls.__name__, name), member))
    return out


CALLABLES = _public_callables()


def test_public_api_is_found():
    names = {n for n, _ in CALLABLES}
    for want in ("meshlm.version", "meshlm.register_family", "meshlm.bf16_to_f32",
                 "meshlm.f32_to_bf16", "meshlm.library_path", "meshlm.tools.run_cli",
                 "Policy.__init__", "Policy.logprobs", "Policy.train_step", "Policy.refit",
                 "Policy.info", "Policy.closed", "MeshlmError.__init__"):
        assert want in names, want


@pytest.mark.parametrize("name,fn", CALLABLES, ids=[n for n, _ in CALLABLES])
def test_annotated(name, fn):
    """Every parameter (self aside) and the return carry an annotation."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if "." in name and name.split(".")[0] in ("Policy", "MeshlmError"):
        assert params and params[0].name == "self", name
        params = params[1:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    assert not missing, "%s: parameters without a type hint: %s" % (name, ", ".join(missing))
    assert sig.return_annotation is not inspect.Signature.empty, \
        "%s: no return type hint" % name


@pytest.mark.skipif(sys.version_info < (3, 9),
                    reason="os.PathLike[str] and subprocess.CompletedProcess[str] "
                           "are subscriptable at run time from Python 3.9")
@pytest.mark.parametrize("name,fn", CALLABLES, ids=[n for n, _ in CALLABLES])
def test_annotations_resolve(name, fn):
    """The (postponed, PEP 563) annotations name things that exist."""
    hints = typing.get_type_hints(fn)
    assert "return" in hints, name


def test_typed_dicts_name_the_struct_fields():
    """PolicyInfo and CallStats declare every field of their C struct."""
    from meshlm import _lib as L
    for td, struct in ((meshlm.PolicyInfo, L.meshlm_info),
                       (meshlm.CallStats, L.meshlm_call_stats)):
        fields = [f[0] for f in struct._fields_ if f[0] != "struct_size"]
        assert list(td.__annotations__) == fields, td.__name__
    result = [f[0] for f in L.meshlm_step_result._fields_ if f[0] != "struct_size"]
    assert set(meshlm.StepResult.__annotations__) == set(result)


def test_py_typed_marker():
    """The package carries the PEP 561 marker (pyproject.toml's package-data
    puts it in the wheel)."""
    assert os.path.isfile(os.path.join(os.path.dirname(meshlm.__file__), "py.typed"))
