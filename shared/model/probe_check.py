"""The recording pass of the probe engine, and the task-creation check built on it.

Both sides need this part: the coordinator runs `check_task_probes` when a task is defined
(`server/service/tasks.py`), and the device's probe engine (`seedfed.client.probes`) starts
every step with the same pass.

`ForwardRecorder.record` runs one forward with hooks on every module and a torch-function mode
that tracks which tensors depend on the scoped tensors ("tainted"). A module that runs once,
holds no scoped tensor and whose inputs and output are all untainted computes the same output
for every probe of a step: its output is kept (the outermost such call's: what ran inside it is
dropped). The `Plan` it returns lists those outputs and estimates what each more stacked copy
of the batch costs; whether the loss is tainted at all says whether the scope can move it.

`check_task_probes` refuses, before any round opens, a scope no tensor of which reaches the
loss and a `Hyper.probe_copies` whose stacked activations exceed `Hyper.probe_memory_mb`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from seedfed.shared.model.scopes import Scope, ScopedTensor
from seedfed.shared.protocol.errors import ScopeError, SeedfedError
from torch import nn
from torch.overrides import TorchFunctionMode

Batch = Mapping[str, torch.Tensor]
LossOnBatch = Callable[[nn.Module, Batch], torch.Tensor]
#: A module owning scoped tensors, with the attribute and scoped tensor of each it owns.
Owned = dict[int, list[tuple[nn.Module, str, ScopedTensor]]]
#: Live activations of one copy, as a multiple of the largest module output it produces or
#: kept output it repeats (a transformer block holds its input, the FFN's wide activation and
#: temporaries; 4.5 is what MiniLM's top layer measured, RSS growth per stacked copy).
ACTIVATION_FACTOR = 4.5


class ProbeMemoryError(SeedfedError, ValueError):
    """The memory a probe needs does not fit the budget the device grants."""


@dataclass(frozen=True)
class ProbeEstimate:
    """What the recording pass measured on one batch (`check_task_probes`)."""

    reaches_loss: bool  # some scoped tensor influences the loss
    shared_bytes: int  # outputs kept for the step (the shared prefix)
    per_copy_bytes: int  # activations of one more stacked copy (estimate)

    def bytes_for(self, copies: int) -> int:
        """Extra memory of `copies` stacked copies beyond a single probe's forward (one copy
        per forward keeps the shared outputs too, but is never refused for them)."""
        return 0 if copies <= 1 else self.shared_bytes + (copies - 1) * self.per_copy_bytes


@dataclass
class Call:
    module: nn.Module
    count: int = 0
    tainted_input: bool = False
    rows: int | None = None  # dim 0 of the first tensor input (the batch, for most modules)
    output: Any = None
    out_bytes: int = 0
    in_bytes: int = 0
    kept: bool = True  # output still held (False: never shareable, or covered by a parent)
    #: the module whose call this one first ran inside (None: called by the caller). Usually
    #: its parent in the module tree; a module may also call one it does not own (a
    #: classifier's sentence-embedding module runs the encoder beside it).
    caller: int | None = None


def tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside nested tuples, lists and dicts (HF ModelOutputs are dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors(o, depth + 1)
    elif depth < 4 and isinstance(obj, Mapping):
        for o in obj.values():
            yield from tensors(o, depth + 1)


def first_rows(args: Any, kwargs: Any) -> int | None:
    for t in tensors((args, kwargs)):
        return int(t.shape[0]) if t.dim() else None
    return None


def nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(obj))


#: Tensor methods writing into their first argument that the trailing-underscore rule misses.
_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                     "__ior__", "__iand__", "__ixor__", "__ipow__", "__ifloordiv__"})


class _Taint(TorchFunctionMode):
    """Marks every tensor computed from a tainted tensor as tainted (weakly: no tensor is kept
    alive by the mark, so recording costs no activation memory)."""

    def __init__(self, sources: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._marks: dict[int, weakref.ref[torch.Tensor]] = {}
        for t in sources:
            self.mark(t)

    def mark(self, t: torch.Tensor) -> None:
        key = id(t)
        if key in self._marks and self._marks[key]() is t:
            return
        marks = self._marks

        def forget(_ref: weakref.ref[torch.Tensor]) -> None:  # the tensor died: free its id
            marks.pop(key, None)

        marks[key] = weakref.ref(t, forget)

    def tainted(self, t: torch.Tensor) -> bool:
        ref = self._marks.get(id(t))
        return ref is not None and ref() is t

    def any_tainted(self, obj: Any) -> bool:
        return any(self.tainted(t) for t in tensors(obj))

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._marks and self.any_tainted((args, kwargs)):
            for t in tensors(out):
                self.mark(t)
            # An in-place op (add_, w[idx] = v, x += y, out=) taints the tensor it writes.
            name = getattr(func, "__name__", "")
            inplace = (name.endswith("_") and not name.endswith("__")) or name in _WRITES
            if inplace and args and isinstance(args[0], torch.Tensor):
                self.mark(args[0])
            for t in tensors(kwargs.get("out")):
                self.mark(t)
        return out


@dataclass
class Plan:
    """The modules a step replaces by their recorded outputs, and the memory estimate."""

    shared: list[Call] = field(default_factory=list)
    owner_rows: dict[int, int] = field(default_factory=dict)  # id(owner) -> rows recorded
    shared_bytes: int = 0
    per_copy_bytes: int = 1


@dataclass(frozen=True)
class Recording:
    """One recorded forward: its loss, whether a scoped tensor reached it, and the plan."""

    loss: torch.Tensor
    reaches_loss: bool
    plan: Plan


class ForwardRecorder:
    """Records forwards of `model` with `scope`'s tensors as the taint sources (module
    docstring). Built once per model and scope: it maps the modules owning scoped tensors
    (`owned`, what a batched forward runs per copy) and those holding one below them."""

    def __init__(self, model: nn.Module, scope: Scope) -> None:
        self.model = model
        self.scope = scope
        owners = scope.owners()
        by_id = {id(t.tensor): t for t in scope}
        self.owned: Owned = {}
        for key, pairs in owners.items():
            for module, attr in pairs:
                self.owned.setdefault(id(module), []).append((module, attr, by_id[key]))
        self._holds_scope = self._modules_holding_scope(owners)
        self._parent: dict[int, int] = {}
        for _, module in model.named_modules():
            for child in module.children():
                self._parent.setdefault(id(child), id(module))

    def _modules_holding_scope(self, owners: dict[int, list[tuple[nn.Module, str]]]
                               ) -> set[int]:
        owner_ids = {id(m) for pairs in owners.values() for m, _ in pairs}
        holding: set[int] = set()
        for _, module in self.model.named_modules():
            if any(id(m) in owner_ids for m in module.modules()):
                holding.add(id(module))
        return holding

    def record(self, batch: Batch, run: Callable[[], torch.Tensor]) -> Recording:
        """Run `run()` (a forward on `batch` returning its loss) under the hooks and the
        taint mode; the plan's shared outputs stay alive until the caller drops it."""
        calls: dict[int, Call] = {}  # in the order modules were first called
        running: list[tuple[int, int]] = []  # (module, calls made before it) of open calls
        taint = _Taint([t.tensor for t in self.scope])

        def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            call = calls.get(id(module))
            if call is None:
                call = calls[id(module)] = Call(module)
                call.rows = first_rows(args, kwargs)
                call.caller = running[-1][0] if running else None
            running.append((id(module), len(calls)))
            call.count += 1
            call.tainted_input = call.tainted_input or taint.any_tainted((args, kwargs))
            call.in_bytes = max(call.in_bytes, nbytes((args, kwargs)))

        def post(module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
            _, before = running.pop()
            call = calls[id(module)]
            call.out_bytes = max(call.out_bytes, nbytes(output))
            # an output that depends on the scope is never shared, whatever the module tree
            # says (a module can read tensors it does not own)
            if call.count > 1 or call.tainted_input or id(module) in self._holds_scope \
                    or taint.any_tainted(output):
                call.output, call.kept = None, False  # never shared: keep nothing alive
                return
            call.output = output
            # Only the outermost shareable module's output is needed: dropping what ran
            # inside it (first called during this call) keeps the recording at the memory of
            # one forward, not of every activation.
            for inner in list(calls.values())[before:]:
                inner.output, inner.kept = None, False

        handles = []
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        try:
            with taint:
                loss = run()
        finally:
            for h in handles:
                h.remove()
        return Recording(loss, taint.tainted(loss), self._plan(calls, nbytes(dict(batch))))

    def _plan(self, calls: dict[int, Call], batch_bytes: int) -> Plan:
        def shareable(c: Call) -> bool:
            return (c.count == 1 and c.kept and not c.tainted_input
                    and id(c.module) not in self._holds_scope and c.module is not self.model)

        ok = {key for key, c in calls.items() if shareable(c)}
        plan = Plan()
        tail_max = kept_max = 0
        for key, c in calls.items():
            if key in ok:
                if self._caller(calls, key) not in ok:
                    plan.shared.append(c)
                    plan.shared_bytes += nbytes(c.output)
                    kept_max = max(kept_max, nbytes(c.output))
                else:
                    c.output = None  # inside a kept module: never called again this step
                continue
            c.output = None
            if key in self.owned and c.rows is not None:
                plan.owner_rows[key] = c.rows
            if not self._under(calls, key, ok):
                tail_max = max(tail_max, c.out_bytes, c.in_bytes)
        # A batched forward repeats each kept output once per copy as its consumer is called
        # (a chain of kept layers frees each repeat when the next one is made), and whatever
        # runs on a repeat outside a module (a classifier's pooling over an encoder's token
        # states) is counted by no module's output: the largest of either, times the live
        # temporaries; and a module that runs on every copy holds its input, which outweighs
        # its output where a wide row narrows (a head over cached sentence embeddings). Every
        # copy's batch rows (`repeat_batch`) live through the forward too.
        plan.per_copy_bytes = max(1, int(ACTIVATION_FACTOR * max(tail_max, kept_max))
                                  + batch_bytes)
        return plan

    def _caller(self, calls: dict[int, Call], key: int) -> int | None:
        """The module a recorded call ran inside (its tree parent if it never ran)."""
        return calls[key].caller if key in calls else self._parent.get(key)

    def _under(self, calls: dict[int, Call], key: int, kept: set[int]) -> bool:
        """Did the module run inside a kept one (its output then never materializes)?"""
        caller = self._caller(calls, key)
        while caller is not None:
            if caller in kept:
                return True
            caller = self._caller(calls, caller)
        return False




#: Tokens of the synthetic sentence `check_task_probes` runs (its figures scale linearly).
CHECK_TOKENS = 16


def _logits_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A loss every logit reaches, for checks that need no labels."""
    return model(**batch).logits.float().square().mean()


def check_task_probes(model: nn.Module, scope: Scope, *, batch_size: int, seq_len: int,
                      copies: int | None, budget_mb: float) -> ProbeEstimate:
    """Refuse, before any round opens, a scope that cannot move the loss and a `copies` whose
    stacked activations for a batch_size x seq_len batch exceed `budget_mb`.

    Runs one unperturbed forward of one synthetic sentence (CHECK_TOKENS tokens) and scales
    the activation estimate linearly to the task's batch (attention's quadratic part is
    underestimated for long sequences; the device measures its own and falls back if need be).
    Raises ScopeError or ProbeMemoryError; returns the scaled estimate.
    """
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise ScopeError(f"{type(model).__name__} names no vocab_size: cannot check its scope")
    tokens = max(1, min(seq_len, CHECK_TOKENS))
    ids = torch.randint(1, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = ids.to(device)  # the sentence goes where the model is (drawn on the CPU: same ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        found = ForwardRecorder(model, scope).record(batch, lambda: _logits_loss(model, batch))
    inner = getattr(getattr(model, "base_model", model), "model", model)
    clear = getattr(inner, "clear_cache", None)
    if callable(clear):  # the synthetic sentence must not linger in a feature cache
        clear()
    if not found.reaches_loss:
        raise ScopeError(f"scope {scope.kind!r}: none of its {len(scope)} tensors (e.g. "
                         f"{scope.names[0]}) influences the model's output, so every scalar "
                         "would be 0")
    scale = batch_size * seq_len / tokens
    est = ProbeEstimate(True, int(found.plan.shared_bytes * scale),
                        int(found.plan.per_copy_bytes * scale))
    if copies is not None and est.bytes_for(copies) > budget_mb * 2**20:
        fits = 1 + max(0, int(budget_mb * 2**20) - est.shared_bytes) // est.per_copy_bytes
        raise ProbeMemoryError(
            f"probe_copies={copies} stacked copies of a {batch_size} x {seq_len} batch need "
            f"~{est.bytes_for(copies) / 2**20:.0f} MB beyond one probe, above probe_memory_mb="
            f"{budget_mb:g}; at most {fits} fit (lower probe_copies, batch_size or "
            "max_seq_len, or raise probe_memory_mb)")
    return est
