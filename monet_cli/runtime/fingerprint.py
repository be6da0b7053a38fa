"""Check on the first forward that a model is the one a schedule was made for.

The check sees through wrappers: DDP runs outside the model, and on modules FSDP2 manages
the ops of its hooks (all-gather before the forward, reshard after it) are skipped, so a
sharded model fingerprints like the unsharded one it was profiled as.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from monet_cli.core.fingerprint import (
    EVERY_MODULE,
    hook_line,
    model_ops,
    modules_hash,
    shapes_hash,
    structure_hash,
    unprofiled_hooks,
)
from monet_cli.core.profile import Fingerprint
from monet_cli.errors import FingerprintError
from monet_cli.workload.step import Workload

# Ops that make no storage and whose presence depends on how autograd saves tensors
# (saved-tensor hooks change when ``detach`` runs); selective checkpointing ignores them
# too. The profiler's recorder and this check both skip them, so fingerprints agree.
IGNORED_OPS = frozenset({"aten.detach.default", "prim.device.default"})


def signature(tensors: list[torch.Tensor]) -> str:
    return ";".join(f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in tensors)


def model_modules_hash(model: nn.Module) -> str:
    def own_tensors(module: nn.Module) -> str:
        named = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        return ",".join(f"{name}:{signature([t])}" for name, t in named)

    return modules_hash((path, type(m).__name__, own_tensors(m)) for path, m in model.named_modules())


# Hooks of PyTorch's own machinery (FSDP2, ModuleTracker) and of monet's (its executor, its
# profiler) are made to run in a recompute; a fingerprint lists only the model's and the user's.
# transformers installs its output-capturing hooks in the first forward that asks for hidden
# states or attentions, and they keep nothing unless a forward asks: not in a training forward
# that does not, nor in a recompute (backward runs outside the forward that set the collector).
_MACHINERY = ("torch.", "monet_cli.runtime.", "monet_cli.profiler.", "transformers.utils.output_capturing.")


def model_hooks(model: nn.Module) -> tuple[str, ...]:
    """The forward hooks and pre-hooks on ``model``'s modules, and the global ones, that the
    model or its user registered: ``Fingerprint.hooks``, sorted."""
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

    places = [(EVERY_MODULE, _global_forward_pre_hooks, _global_forward_hooks)]
    places += [(path, m._forward_pre_hooks, m._forward_hooks) for path, m in model.named_modules()]
    lines = [
        hook_line(path, kind, name)
        for path, pre_hooks, hooks in places
        for kind, found in (("forward_pre", pre_hooks), ("forward", hooks))
        for hook in found.values()
        if not (name := _function_name(hook)).startswith(_MACHINERY)
    ]
    return tuple(sorted(lines))


def _function_name(hook: Any) -> str:
    function = getattr(hook, "func", hook)  # functools.partial
    module = getattr(function, "__module__", None) or type(function).__module__
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


def torch_version() -> str:
    return torch.__version__.split("+")[0]


OLDEST_TESTED_TORCH = (2, 11)
"""The oldest torch the whole suite has passed on (2.11.0; also 2.14.1). Below it monet still
runs but promises nothing it has not measured."""


def warn_if_untested_torch() -> None:
    """A torch below the tested floor (installed with --no-deps on a GPU image) still runs, loudly."""
    found = tuple(int(part) for part in torch_version().split(".")[:2] if part.isdigit())
    if found < OLDEST_TESTED_TORCH:
        oldest = ".".join(map(str, OLDEST_TESTED_TORCH))
        warnings.warn(
            f"monet: torch {torch_version()} is older than {oldest}, the oldest torch monet is tested on: "
            "its memory and gradient promises are unverified here",
            stacklevel=2,
        )


class OpSequence(TorchDispatchMode):
    """Records (overload, module path, argument signature) of every forward op."""

    def __init__(self, stack: ModuleStack, skip: Any = None) -> None:
        super().__init__()
        self.stack = stack
        self.skip = skip
        self.ops: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        skipped = self.stack.in_wrapper_hook() or (self.skip is not None and self.skip.active)
        if name not in IGNORED_OPS and not skipped:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.ops.append((name, self.stack.path(), signature(tensors)))
        return func(*args, **kwargs)

    def fingerprint(self, device_type: str, precision: str) -> Fingerprint:
        ops = model_ops(self.ops, lambda op: op[1])
        return Fingerprint(
            structure=structure_hash((op, module) for op, module, _ in ops),
            shapes=shapes_hash(sig for _, _, sig in ops),
            device_type=device_type,
            torch=torch_version(),
            precision=precision,  # type: ignore[arg-type]
        )


def forward_fingerprint(workload: Workload) -> Fingerprint:
    """The fingerprint of one training forward of the workload's model on its inputs (no backward)."""
    with ModuleStack(workload.model) as stack:
        sequence = OpSequence(stack)
        with sequence:
            workload.run_model()
    return sequence.fingerprint(workload.device.type, workload.spec.precision)


def runtime_precision(device_type: str) -> str:
    """The precision a forward runs in right now, by its autocast state."""
    if not torch.is_autocast_enabled(device_type):
        return "32"
    dtype = torch.get_autocast_dtype(device_type)
    return {torch.bfloat16: "bf16-mixed", torch.float16: "fp16-mixed"}.get(dtype, f"autocast {dtype}")


def _wrapped_modules(root: nn.Module) -> list[nn.Module]:
    """Modules whose hooks run a wrapper's machinery (FSDP2's ``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return []
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


class ModuleStack:
    """Tracks the innermost running module's path, and whether a wrapper's hooks are running.

    PyTorch runs global hooks before module hooks, before and after the forward. A wrapper
    (FSDP2) prepends its pre-forward hook and appends its post-forward one; monet appends
    one of each after it, so on a wrapped module only the wrapper's machinery runs between
    the global pre-hook and monet's pre-hook, and between the global post-hook and monet's
    post-hook. Ops there are not the model's.
    """

    def __init__(self, root: nn.Module) -> None:
        self.names = {id(m): name for name, m in root.named_modules()}
        self.wrapped = _wrapped_modules(root)
        self.stack: list[list[Any]] = []
        """[module path, whether its wrapper's hooks (not its forward) are running, id of the module]"""
        self._handles: list[Any] = []

    def path(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def in_wrapper_hook(self) -> bool:
        return bool(self.stack) and self.stack[-1][1]

    def enter_root(self, root: nn.Module) -> None:
        """The root's hooks already ran when checking starts from its pre-hook."""
        self.stack.append(["", False, id(root)])

    def __enter__(self) -> ModuleStack:
        wrapped = {id(m) for m in self.wrapped}

        def pre(module, args):
            name = self.names.get(id(module), f"<{type(module).__name__}>")
            self.stack.append([name, id(module) in wrapped, id(module)])

        def post(module, args, output):
            if not self.stack:
                return
            if id(module) in wrapped:
                self.stack[-1][1] = True  # the wrapper's post-hook comes next
            else:
                self.stack.pop()

        def body_starts(module, args):
            if self.stack and self.stack[-1][2] == id(module):
                self.stack[-1][1] = False

        def wrapper_done(module, args, output):
            if self.stack and self.stack[-1][2] == id(module):
                self.stack.pop()

        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post),
        ]
        for module in self.wrapped:
            self._handles.append(module.register_forward_pre_hook(body_starts))
            self._handles.append(module.register_forward_hook(wrapper_done))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self.stack.clear()


def mismatch(expected: Fingerprint, found: Fingerprint) -> str | None:
    """Why two fingerprints differ, in words, or None when they match."""
    if expected.device_type != found.device_type:
        return f"it was made on {expected.device_type}, this model runs on {found.device_type}"
    if expected.torch != found.torch:
        return f"it was made with torch {expected.torch}, this is torch {found.torch}"
    if expected.precision != found.precision:
        return f"it was made for precision {expected.precision}, this forward runs in {found.precision}"
    if expected.structure != found.structure:
        return "the model's ops differ (another model or architecture)"
    if expected.shapes != found.shapes:
        return "the input shapes differ (another batch size or input size)"
    return None


class FirstForwardCheck:
    """Fingerprints the first training forward and raises on mismatch."""

    def __init__(self, model: nn.Module, expected: Fingerprint, skip: Any) -> None:
        self.model = model
        self.expected = expected
        self.skip = skip
        self.done = False
        self._state: tuple[ModuleStack, OpSequence, dict[str, str]] | None = None
        self._handles: list[Any] = []

    def install(self) -> None:
        self._handles = [
            self.model.register_forward_pre_hook(self._start),
            # always_call: a forward that raises must still take the check's modes off the
            # stack, or they would stay on for everything the process runs after it.
            self.model.register_forward_hook(self._finish, always_call=True),
        ]

    def _start(self, module: nn.Module, args: Any) -> None:
        if self.done or not torch.is_grad_enabled() or not module.training:
            return
        stack = ModuleStack(self.model).__enter__()
        stack.enter_root(self.model)
        sequence = OpSequence(stack, self.skip)
        sequence.__enter__()
        self._state = (stack, sequence, {kind: runtime_precision(kind) for kind in ("cpu", "cuda")})

    def _finish(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._state is None:
            return
        stack, sequence, precision = self._state
        sequence.__exit__(None, None, None)
        stack.__exit__(None, None, None)
        self._state = None
        if sys.exc_info()[1] is not None:
            return  # the forward raised (torch runs this hook inside its handler): check the next one
        self.done = True
        for handle in self._handles:
            handle.remove()
        device = _device_of(args, output)
        problem = mismatch(self.expected, sequence.fingerprint(device, precision[device]))
        if problem:
            raise FingerprintError(f"schedule does not match this model: {problem}")


def hooks_problem(profiled: tuple[str, ...], model: nn.Module) -> str | None:
    """Why ``model``'s hooks do not match the profile's, or None. A hook registered after the
    profile (in a training loop, before or after ``apply``) that keeps what it is given holds
    tensors the profile saw freed, and in a recompute the recomputed ones too: the profile
    neither measured nor rehearsed it. Hooks the profile saw and the model lacks are harmless."""
    new = unprofiled_hooks(profiled, model_hooks(model))
    if not new:
        return None
    path, kind, function = new[0].split("|", 2)
    where = "every module" if path == EVERY_MODULE else f"'{path or '<model>'}'"
    more = f" (and {len(new) - 1} more)" if len(new) > 1 else ""
    return (
        f"{where} has a {kind.replace('_', ' ')} hook the profile did not see ({function}){more}; what a hook "
        "keeps is not in the prediction, and a recompute runs it again: register hooks in the model's factory, "
        "so the profile measures and rehearses them, and profile again"
    )


def _device_of(args: Any, output: Any) -> str:
    for tensor in tree_flatten((args, output))[0]:
        if isinstance(tensor, torch.Tensor):
            return tensor.device.type
    return "cpu"


AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def fake_cuda_fingerprint(model: nn.Module, args: tuple, kwargs: dict, precision: str) -> Fingerprint:
    """The fingerprint of one training forward run on fake CUDA tensors: no GPU and no compute,
    but PyTorch's CUDA dispatch (cuDNN BatchNorm, autocast's CUDA casts). Kernels PyTorch picks
    by asking the GPU itself (attention's fused backends) come out other than on a real GPU.

    Raises RuntimeError when this torch cannot make fake CUDA tensors (a CPU-only build)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not torch.backends.cuda.is_built():
        raise RuntimeError(f"torch {torch.__version__} is a CPU-only build")
    mode = FakeTensorMode()
    with mode:
        state = {
            name: mode.from_tensor(t).to("cuda") for name, t in (*model.named_parameters(), *model.named_buffers())
        }
        args, kwargs = tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t).to("cuda"), (args, kwargs))
    dtype = AUTOCAST_DTYPES.get(precision)
    with ModuleStack(model) as stack:
        sequence = OpSequence(stack)
        # torch.autocast("cuda") turns itself off without a GPU; the state it sets does not.
        enabled, old_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        try:
            with mode, sequence:
                if dtype is not None:
                    torch.set_autocast_enabled("cuda", True)
                    torch.set_autocast_dtype("cuda", dtype)
                torch.func.functional_call(model, state, args, kwargs)
        finally:
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", old_dtype)
            torch.clear_autocast_cache()
    return sequence.fingerprint("cuda", precision)
