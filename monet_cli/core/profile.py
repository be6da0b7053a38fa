"""The profile: what one real training step of a model costs, op by op.

Positions: every aten op the step runs gets a position. Forward ops (model, then loss)
take 0..len(ops)-1, backward and optimizer ops follow (``BackwardOp.pos``). A storage
with ``alloc=a`` and ``free=f`` is live while ops a..f-1 run; ``free=None`` means it
outlives the step (parameters, gradients, optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from monet_cli.core.allocator import max_split_bytes, non_split_rounding_bytes
from monet_cli.core.codec import flow_row, from_data, to_data
from monet_cli.core.yamlio import atomic_write_text, dump_yaml, load_yaml_file
from monet_cli.errors import FileFormatError

SCHEMA_VERSION = 1
PROFILE_KIND = "monet.profile"
PRECISIONS = ("32", "bf16-mixed", "fp16-mixed")
"""Lightning's names: full fp32, or the step under ``torch.autocast`` in bfloat16 / float16."""
Precision = Literal["32", "bf16-mixed", "fp16-mixed"]
LOSS_MODULE = "<loss>"  # module path of the ops that compute the loss, outside the model


@dataclass(frozen=True, kw_only=True, slots=True)
class InputSpec:
    shape: tuple[int, ...]
    """Per-sample shape, without the batch dimension."""
    dtype: str = "float32"
    low: int | None = None
    """Integer inputs (token ids) are drawn uniformly from [low, high)."""
    high: int | None = None
    name: str | None = None
    """Keyword the model's forward takes this input as (``input_ids``, ``labels``); None: positional."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    name: Literal["sgd", "adamw", "none"] = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Everything needed to rebuild the same model and training step elsewhere."""

    spec: str
    """What the user typed: a run config, a torchvision name or ``package.module:function``."""
    name: str
    source: Literal["torchvision", "import", "hf", "timm"]
    target: str
    """What builds the model: a torchvision or timm model name, an import path, or for ``hf`` a
    transformers model class or model type (its config fields are ``kwargs``)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int
    inputs: tuple[InputSpec, ...]
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    loss: str = "auto"
    seed: int = 0
    precision: Precision = "32"
    out_of_place_activations: bool = True
    """monet runs activation modules (ReLU, ...) out of place so their outputs can be kept."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    type: str
    name: str
    total_memory_bytes: int
    alloc_conf: str = ""
    """CUDA: the caching allocator's settings while profiling (``PYTORCH_CUDA_ALLOC_CONF``;
    empty: PyTorch's defaults). They decide how the allocator counts a step's blocks
    (``core.allocator``)."""

    def __post_init__(self) -> None:
        max_split_bytes(self.alloc_conf)  # a hand-edited value the replay cannot read: refused on load
        non_split_rounding_bytes(self.alloc_conf)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvInfo:
    monet: str
    torch: str
    torchvision: str
    ortools: str
    python: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    structure: str
    """Hash of the forward op sequence (overload names and module paths)."""
    shapes: str
    """Hash of every forward op's tensor argument shapes and dtypes."""
    device_type: str
    torch: str
    precision: Precision = "32"
    """The autocast mode of the forward: its casts are part of the op sequence and of memory."""
    modules: str = ""
    """Hash of the module tree with parameter and buffer shapes (empty in files made before it):
    checked by ``monet validate`` where the op sequence cannot be (a CUDA schedule on a CPU)."""
    hooks: tuple[str, ...] | None = None
    """The model's forward hooks and pre-hooks when it was profiled, ``path|kind|function`` each
    (``core.fingerprint.hook_line``; None in files made before it). The profile measured what
    these keep and rehearsed them in recomputes: a schedule refuses a model with others."""
    output_bytes: int | None = None
    """Bytes of the tensor storages a training forward returned: a loop holding the output
    (``outputs = model(batch)``) holds them, and the profile's step did. None in files made
    before it was recorded."""


SPEED_CHANGE = 1.2
"""Two medians of the same plain step this many times apart ran at another speed: every price
is taken at the speed of its own stretch of the profile, and one resnet50 profile on this CPU
timed its step at 1,997 ms while the bench that followed ran it at 1,249."""
SPEED_CHANGE_MIN_MS = 1.0
"""Nor is a change of less than this one: on sub-millisecond steps it is the timer's and
Python's jitter (a test model's 0.7 ms step came out 1.2x slower at the end of its profile)."""


def other_speed(first_ms: float, second_ms: float) -> bool:
    """Whether two medians of one plain step say the machine ran at another speed."""
    ratio = max(first_ms / second_ms, second_ms / first_ms)
    return ratio > SPEED_CHANGE and abs(first_ms - second_ms) >= SPEED_CHANGE_MIN_MS


@dataclass(frozen=True, kw_only=True, slots=True)
class Baseline:
    peak_bytes: int
    """Measured peak of the unscheduled step (live tensor storages on CPU, the allocator on CUDA)."""
    step_ms: float
    """Median wall time of the timed steps: no op recorded, each module call's forward timed
    by global hooks (a few microseconds a call), so calls and step are timed in one step."""
    steps: int
    peak_pos: int
    """Position of the op during which the recorded peak happened."""
    meter: str
    """How peak_bytes was measured: ``live-storages`` or ``cuda-allocator``."""
    as_written_step_ms: float | None = None
    """The step of the model as its factory built it, where monet's preparation changes its
    time (in-place activations switched out of place, as every schedule runs them): what a
    schedule's overhead is taken against. Measured paired with ``step_ms``'s steps and put in
    their time; None where nothing is switched or the step is too slow to pair."""
    other_work_cpus: float | None = None
    """CPUs other processes kept busy on average while the profile ran, on the CPUs it may run
    on: its times assume none (``runtime/sharing.py``). None where it was not read (a CUDA
    profile, not Linux, or a profile made before it was recorded)."""

    @property
    def reference_step_ms(self) -> float:
        """The step a schedule's overhead is taken against: the model as written where measured."""
        return self.as_written_step_ms if self.as_written_step_ms is not None else self.step_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySummary:
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    saved_activation_bytes: int
    """Bytes autograd keeps for backward once the loss is computed (parameters excluded)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Overheads:
    """Time the checkpoint machinery itself costs on this device, measured by ``monet profile``."""

    segment_ms: float = 0.0
    """One checkpointed call, forward and backward, beyond re-running its ops and beyond
    ``saved_tensor_ms`` per saved tensor. Timed in the model's own step where steps are short
    enough to pair (``profiler/in_step.py``), else on a few of its calls alone
    (``profiler/alone.py``; a chain of tanh ops where none can run alone)."""
    first_frame_ms: float = 0.0
    """What the step pays once when it checkpoints anything, beyond each frame's ``segment_ms``.
    On tiny_gpt (batch 16, this 2-core CPU) one checkpointed GELU added 1.2 ms to the step,
    two 1.7, three 2.2, four 2.9 and sixteen cheap calls 7.7: about 0.7 ms once and 0.45 a
    frame. Timed in the model's own step where steps are short enough to pair, else 0: a call
    timed alone pays it in its frame's price (``segment_ms``), as do profiles made before it
    was measured. Profiles made on 12-07 before ``checks_ms`` was measured hold the checks
    here."""
    checks_ms: float = 0.0
    """The checks every schedule runs on each training forward (``runtime/guards.py``: another
    planner's checkpointing, a padded batch, a second forward, the output's bytes), their
    hooks' own time: paid by a schedule of operator variants alone too. On tiny_gpt (batch 16,
    12-07) a schedule of no segment ran 0.2 to 0.6 ms a step slower than the model without
    it. Timed in the model's own step where steps are short enough to pair, else 0 (a step of
    300 ms or more, where they are 0.1 to 0.2% of it)."""
    price_noise_ms: float = 0.0
    """How far the step's noise alone may move the prices timed in the step: half the 90%
    interval (the sign test's) of the median difference the largest calls checkpointed made,
    in the profile's time. A deep schedule re-runs about what that set re-runs, so its
    predicted step may be off by this much from the profile's noise alone. Taken over both
    batches of rounds where the step's noise ran the sets twice (``profiler/in_step.py``). In
    a noisy spell of this CPU (12-07, plain steps of 108 to 184 ms with standard deviations of
    12 to 22 ms) one batch put it at 3.1 to 10.0 ms on the unet and ``tiny_gpt``, two at 2.7 to
    5.6. 0 where not measured (calls timed alone, older profiles)."""
    saved_tensor_ms: float = 0.0
    """Each tensor autograd saves inside a segment: the frame's pack hook in the forward and
    again in the recompute, and its unpack. Profiles made before it was measured say 0 (their
    ``segment_ms`` then covers a segment of 20 saved tensors)."""
    policy_op_ms: float = 0.0
    """Each op inside a segment with a selective keep policy (its dispatch modes run in forward and
    recompute). Timed where ``segment_ms`` is: in the step, on calls alone or on tanh ops."""
    python_op_ms: float = 0.0
    """What each op a recompute re-runs costs beyond what the profile prices it at (its share of
    the wall time of the code it runs, ``ModuleCall.time_ms``): a recompute runs during
    backward, with checkpoint's unpacking around it. Timed in the model's own step (its largest
    calls checkpointed) or on calls alone, where ``segment_ms`` is, else 0. A kept op pays it too: its code
    runs, its kernel does not. In profiles without wall times it also holds the code's cost."""
    range_op_ms: float = 0.0
    """Each of an op range's own ops beyond plain checkpoint's cost: written to the tape in the
    forward and replayed from it in the recompute, in Python. Timed on one of the model's own
    ranges where one qualifies (``profiler/probe.py``), else on a chain of tanh ops.
    Profiles made before it was measured say 0, and price a range as plain checkpoint."""
    range_record_op_ms: float | None = None
    """The recording's share of ``range_op_ms``: what a nested range's own ops cost again when
    an outer segment's recompute runs its forward, which records the tape anew (its replay
    runs once either way). Timed with ``range_op_ms`` on the model's own range; None where
    that was not (the chain, and profiles made before it was measured): a range recorded
    again is then priced at ``range_op_ms``, an upper bound."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """Copies between device memory and pinned host memory, measured by ``monet profile`` on a
    CUDA device (a CPU profile has none: nothing to offload to). A copy of n bytes takes
    ``fixed_ms + n / bytes_per_ms`` in each direction, fitted to copies of a few sizes."""

    fixed_ms: float
    to_host_bytes_per_ms: float
    to_device_bytes_per_ms: float


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class OpRecord:
    index: int
    op: str
    """The aten overload, e.g. ``aten.convolution.default``."""
    module: str
    """Path of the innermost module running it; ``""`` is the model itself."""
    time_ms: float
    out_bytes: int
    """Bytes of new storage the op produces."""
    saved_bytes: int
    """Bytes of its storages autograd keeps for backward (in-place ops count with their producer)."""
    inplace_of: int | None = None
    """For an in-place op, the op whose storage it writes."""
    inputs: tuple[int, ...] = ()
    """Forward ops whose storages this op reads (parameters and inputs excluded)."""
    consumers: tuple[int, ...] = ()
    workspace_bytes: int = 0
    """CUDA: the allocator's peak inside the op above its level once the op returned
    (cuBLAS and cuDNN workspaces, a kernel's temporaries). Not measured on CPU."""
    unreplayable: str = ""
    """Why an op range cannot hold it among its own ops (empty when one can): a range replays
    its own code as the torch calls it recorded, so an op of a custom autograd Function would
    run without the Function (autograd would save other tensors), and one drawing from a
    generator passed to it would draw other numbers (checkpoint restores the default RNG
    only). Empty in profiles made before it was recorded."""
    torch_call_end: int | None = None
    """One past the last op of the torch function call that ran it, outermost (its own index
    plus one when it ran in none): a range's replay repeats that call as one, holding its
    arguments until it returns. None in profiles made before it was recorded."""


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleCall:
    index: int
    fqn: str
    type: str
    first_op: int
    end_op: int
    """One past the last op run inside the call."""
    parent: int | None
    checkpointable: bool
    """A segment candidate: called once, runs ops, does not write its inputs in place, and
    re-running its forward (as checkpoint's recompute does) repeats it exactly."""
    inputs: tuple[int, ...] = ()
    """Storages of its tensor arguments: checkpoint holds them until its backward is done."""
    hand_off: bool = False
    """Called with the tensor its parent's previous call returned, alone (one positional
    argument, no keyword): it can follow that call in a chain, whose recompute hands each
    member the one before's output alone. ``inputs`` cannot say it: vit_b_16's attention takes
    its LayerNorm's output three times and a keyword, and a call returning a tuple hands no
    tensor on. False in profiles made before it was recorded: they offer no chains."""
    reason: str = ""
    """Why the call is not checkpointable (empty when it is)."""
    hooks_reason: str = ""
    """Why the call cannot run again as a call, its module's own hooks and all, as a chain's
    or an op range's recompute runs it (empty when it can): a forward hook that stores what
    the call makes would hold the recomputed tensors too. Checkpoint re-runs a segment's
    forward without the module's own hooks, so the call may still be a segment. Empty in
    profiles made before it was recorded."""
    time_ms: float | None = None
    """Median wall time of its forward in plain steps, its Python included: what re-running the
    call costs, where its ops' timed sum is what their kernels cost. None in profiles made
    before it was measured."""

    @property
    def registered(self) -> bool:
        """Whether the module is one of the model's own submodules, which a schedule names by
        path. A module object called from outside the tree (transformers' LLaMA calls its
        rotary embedding through one shared ``Func`` module) is recorded as ``<Type>``."""
        return not self.fqn.startswith("<")


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class StorageRecord:
    id: int
    bytes: int
    kind: Literal["param", "buffer", "input", "output", "grad", "optimizer", "activation", "temp", "other"]
    producer: int | None
    """Position of the op that allocated it; None for storages that existed before the step."""
    alloc: int
    free: int | None
    free_no_autograd: int | None = None
    """For forward storages: where it is freed when autograd keeps nothing (recompute candidates)."""
    mutated: bool = False
    """Written in place after it was produced: such a storage cannot be kept by a schedule."""
    returned_to: int | None = None
    """For an activation: the module call whose own code the forward last handed it to, a torch
    call it made or a call it made having returned it (an op range's replay holds such a
    tensor only until its last reader: ``SegmentModel.replay_drop``). None: none did (a
    call's internal kept by a cache, autocast's copy of a weight), or a profile made before
    it was recorded."""


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class PackRecord:
    """Autograd saved a storage for backward (one record per save)."""

    storage: int
    call: int | None
    """Innermost module call running when it was saved (None: outside the model)."""
    pos: int
    """Number of forward ops started when it was saved."""
    unpack: int | None
    """Backward position at which its node first used it."""
    release: int | None
    """Position before which autograd dropped it (its node finished)."""


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class BackwardOp:
    pos: int
    op: str
    phase: Literal["backward", "optimizer"]
    time_ms: float
    workspace_bytes: int = 0
    """As ``OpRecord.workspace_bytes``."""


VARIANT_ROLES = {"bn_output": ("bn", "activation", "conv"), "maxpool_offsets": ("maxpool",)}
"""Per operator variant, the part each of its ops plays (the last role repeats for the rest)."""


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class VariantSite:
    impl: Literal["bn_output", "maxpool_offsets", "offload"]
    ops: tuple[int, ...]
    """Forward op indices it changes; the first names the site (the BatchNorm, the pooling, the
    first op of an offloaded call)."""
    modules: tuple[str, ...]
    """Module path running each of ``ops`` (an offload: the path of the call it covers, once)."""

    @property
    def op(self) -> int:
        return self.ops[0]

    @property
    def module(self) -> str:
        return self.modules[0]

    def site(self) -> dict[str, object]:
        """The site's own fields, to make a record or a decision of the same site."""
        return {name: getattr(self, name) for name in VariantSite.__dataclass_fields__}

    def roles(self) -> list[tuple[str, str]]:
        """(role, module path) of every module the variant runs in."""
        roles = VARIANT_ROLES[self.impl]
        return [(roles[min(k, len(roles) - 1)], path) for k, path in enumerate(self.modules)]


@flow_row
@dataclass(frozen=True, kw_only=True, slots=True)
class VariantRecord(VariantSite):
    """A site as ``monet profile`` measured it."""

    time_ms: float
    """The variant's forward and backward minus the unmodified modules', same inputs, interleaved
    medians (may be below zero: inside the timing noise)."""
    saved_bytes: int
    """Bytes of activations the variant's nodes keep for backward, measured with saved-tensor hooks."""
    native_saved_bytes: int
    """The same for the unmodified modules."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    schema_version: int
    kind: str
    model: ModelSpec
    device: DeviceInfo
    env: EnvInfo
    fingerprint: Fingerprint
    baseline: Baseline
    memory: MemorySummary
    overheads: Overheads = field(default_factory=Overheads)
    transfer: Transfer | None = None
    """Host-device copy speed, on CUDA only: what an offload costs (``monet_cli/core/offload.py``)."""
    created_at: str
    ops: tuple[OpRecord, ...]
    backward: tuple[BackwardOp, ...]
    calls: tuple[ModuleCall, ...]
    storages: tuple[StorageRecord, ...]
    packs: tuple[PackRecord, ...]
    variants: tuple[VariantRecord, ...] = ()
    """Where an operator variant applies, as measured (``monet_cli/core/variants.py``)."""

    def __post_init__(self) -> None:
        for i, op in enumerate(self.ops):
            if op.index != i:
                raise ValueError(f"ops[{i}] has index {op.index}: ops must be numbered 0, 1, 2, ...")
        for j, bop in enumerate(self.backward):
            if bop.pos != len(self.ops) + j:
                raise ValueError(f"backward[{j}] has pos {bop.pos}, expected {len(self.ops) + j}")

    @property
    def num_positions(self) -> int:
        return len(self.ops) + len(self.backward)

    @property
    def op_ms_sum(self) -> float:
        """The profiled op times added up: against ``baseline.step_ms`` it shows what the per-op
        timing leaves out (Python between ops) or adds (a synchronisation per op on CUDA)."""
        return sum(op.time_ms for op in self.ops) + sum(op.time_ms for op in self.backward)


# Written only where measured (CUDA, the hooks) or where they apply (an op a range cannot
# replay, a call whose hooks keep tensors), so a profile does not repeat a default on every row.
OMITTED_WHEN_DEFAULT = frozenset(
    {
        "OpRecord.workspace_bytes",
        "OpRecord.unreplayable",
        "StorageRecord.returned_to",
        "ModuleCall.hooks_reason",
        "BackwardOp.workspace_bytes",
        "Fingerprint.hooks",
        "Fingerprint.output_bytes",
        "Profile.transfer",
        "DeviceInfo.alloc_conf",
    }
)


def dump_profile(profile: Profile) -> str:
    return dump_yaml(to_data(profile, omit_defaults=OMITTED_WHEN_DEFAULT))


def save_profile(profile: Profile, path: Path) -> None:
    atomic_write_text(Path(path), dump_profile(profile))


def check_header(data: dict[str, Any], *, source: str, kind: str, versions: tuple[int, ...] = (SCHEMA_VERSION,)) -> int:
    """Reject the wrong kind of file or an unknown schema version before anything else; return the version."""
    found_kind = data.get("kind")
    if found_kind != kind:
        if isinstance(found_kind, str) and found_kind.startswith("monet."):
            raise FileFormatError(f"{source}: kind: this is a {found_kind} file, expected {kind}")
        raise FileFormatError(f"{source}: kind: expected '{kind}', got {found_kind!r}")
    version = data.get("schema_version")
    if version is None:
        raise FileFormatError(f"{source}: schema_version: missing key")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FileFormatError(f"{source}: schema_version: expected int, got {version!r}")
    if version not in versions:
        hint = "written by a newer monet: upgrade monet" if version > max(versions) else "no longer supported"
        readable = " and ".join(map(str, versions))
        raise FileFormatError(
            f"{source}: schema_version: {version} is not supported (this monet reads {readable}; {hint})"
        )
    return version


def profile_from_data(data: dict[str, Any], *, source: str) -> Profile:
    check_header(data, source=source, kind=PROFILE_KIND)
    return from_data(Profile, data, source=source)


def load_profile(path: Path) -> Profile:
    path = Path(path)
    return profile_from_data(load_yaml_file(path), source=str(path))
