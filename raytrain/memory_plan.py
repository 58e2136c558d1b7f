"""Per-device model-state memory for DDP and ZeRO-1/2/3, and which parallel layout to start with.

Accounting (ZeRO paper, Rajbhandari et al. 2019, Section 3 and Figure 1). With Ψ parameters, N data-parallel
devices and, per parameter, p bytes of parameters, g bytes of gradients and o bytes of optimizer states
(`StateBytes`), the *model states* one device holds are

    ddp:    (p + g + o) Ψ
    zero1:  (p + g) Ψ   + o Ψ / N          optimizer states sharded
    zero2:   p Ψ        + (g + o) Ψ / N    gradients sharded too
    zero3:  (p + g + o) Ψ / N              parameters sharded too

A sharded state is split the way DeepSpeed and FSDP pad their flat buffers: every device holds ceil(Ψ / N)
parameters' worth of it, so Ψ / N above is ceil(Ψ / N) and every byte count is an exact integer (equal to the
formula whenever N divides Ψ). The optimizer kinds (`BYTES_PER_PARAM`, bytes per parameter p + g + o):

    mixed_adam    2 + 2 + 12   fp16/bf16 params and grads; fp32 master params, momentum and variance (K = 12)
    adam          4 + 4 + 8    fp32 params and grads; momentum and variance
    sgd_momentum  4 + 4 + 4    fp32 params and grads; momentum
    sgd           4 + 4 + 0    fp32 params and grads

For Ψ = 7.5e9, N = 64 and mixed_adam this gives 120, 31.4, 16.6 and 1.9 GB (GB = 1e9 bytes), the paper's
Figure 1 (exactly 120, 31.40625, 16.640625 and 1.875 GB). Activations, temporary buffers, the CUDA context
and allocator fragmentation are *not* model states; `plan_memory` keeps `reserve_fraction` (default 0.2) of
the device memory free for them, so the budget for model states is ``gpu_memory_bytes * (1 -
reserve_fraction)``. The reserve is a rule of thumb, not a measurement: activations grow with micro-batch size
and sequence length and can need far more than 20 %.

Recommendation (start with DDP; when memory does not suffice, ZeRO/FSDP; when the model still does not fit,
tensor parallel inside a node and pipeline parallel across nodes), the first layout that fits the budget:

1. ``ddp``, then ``zero1``, then ``zero2`` (least communication first).
2. ``zero3`` if its bytes plus its *gathered working set* fit. ZeRO-3 must materialise one unit's full
   parameters and their gradients at a time, (p + g) x largest_layer_params bytes. With only a parameter count
   the largest unit is unknown and taken as 0, which is optimistic; pass ``largest_layer_params`` (for
   example from `count_parameters` on the model) to account for it.
3. Tensor + pipeline parallel in the Megatron-DeepSpeed 3D layout: tensor-parallel degree d divides
   ``gpus_per_node`` (TP traffic stays inside a node), pipeline stages s divide the number of nodes, and the
   remaining dp = N / (d s) replicas shard the optimizer states with ZeRO-1. One device holds

       (p + g) Ψ / (d s) + o Ψ / (d s dp)  =  (p + g) Ψ / (d s) + o Ψ / N

   and gathers nothing. Tried in order: ``tp=d`` for every divisor d > 1 of ``gpus_per_node`` increasing,
   then ``tp=<gpus_per_node>,pp=s`` for every divisor s > 1 of the node count increasing.
4. Otherwise ``none``; the reason names the smallest device count with which ZeRO-3 would fit.

Honest caveat: on model-state bytes alone ZeRO-3 over all N devices is the most compact layout there is
(every TP/PP layout above holds at least as many bytes per device). TP/PP is therefore recommended only when
ZeRO-3's gathered working set is what breaks the budget; in practice TP/PP is also chosen for activation
memory and communication volume, which this model-state plan does not see.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from raytrain.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

OptimizerKind = Literal["mixed_adam", "adam", "sgd_momentum", "sgd"]
Strategy = Literal["ddp", "zero1", "zero2", "zero3"]
OPTIMIZER_KINDS: tuple[str, ...] = get_args(OptimizerKind)
STRATEGIES: tuple[str, ...] = get_args(Strategy)

GB = 10**9


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state: parameters, gradients, optimizer states."""

    param: int
    grad: int
    optim: int

    @property
    def total(self) -> int:
        """p + g + o: bytes per parameter when nothing is sharded."""
        return self.param + self.grad + self.optim


BYTES_PER_PARAM: dict[OptimizerKind, StateBytes] = {
    "mixed_adam": StateBytes(param=2, grad=2, optim=12),
    "adam": StateBytes(param=4, grad=4, optim=8),
    "sgd_momentum": StateBytes(param=4, grad=4, optim=4),
    "sgd": StateBytes(param=4, grad=4, optim=0),
}


@dataclass(frozen=True)
class MemoryPlan:
    """Model-state bytes per device for each strategy, and the layout recommended for a memory budget.

    `recommendation` is ``""`` and `budget_bytes` is None when no device memory was given; otherwise it is
    one of ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``tp=<d>``, ``tp=<d>,pp=<s>`` or ``none``, and `reason`
    is one sentence saying why. `working_set_bytes` is ZeRO-3's gathered working set (0 if unknown) and
    `recommended_bytes` the per-device model-state bytes of the recommended layout (None without one).
    """

    num_params: int
    num_devices: int
    optimizer: OptimizerKind
    bytes_per_device: dict[str, int]
    recommendation: str
    budget_bytes: int | None
    reason: str
    working_set_bytes: int = 0
    recommended_bytes: int | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(field: str, value: object, minimum: int) -> int:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise ConfigError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def _check_optimizer(optimizer: object) -> StateBytes:
    if not isinstance(optimizer, str) or optimizer not in BYTES_PER_PARAM:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZER_KINDS)}, got {optimizer!r}")
    return BYTES_PER_PARAM[optimizer]


def _shard(num_params: int, parts: int) -> int:
    """Parameters per device when `num_params` are split (padded) over `parts` devices."""
    return -(-num_params // parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def format_bytes(num_bytes: int | float) -> str:
    """`num_bytes` in the largest unit that keeps the number >= 1: B, kB, MB, GB, TB (powers of 1000)."""
    value = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(float(f"{value:.3g}")) < 1000:  # as printed: 999.5 kB shows as 1 MB, not "1e+03 kB"
            return f"{value:.3g} {unit}"
        value /= 1000
    return f"{value:.3g} TB"


def _gb(num_bytes: int | float) -> str:
    return f"{num_bytes / GB:.3g} GB"


def model_state_bytes(
    num_params: int, strategy: Strategy, num_devices: int, optimizer: OptimizerKind = "mixed_adam"
) -> int:
    """Model-state bytes one device holds for `strategy` over `num_devices` data-parallel devices.

    ddp (p+g+o)Ψ, zero1 (p+g)Ψ + oΨ/N, zero2 pΨ + (g+o)Ψ/N, zero3 (p+g+o)Ψ/N with Ψ/N rounded up to whole
    parameters (padded shards) and p, g, o from ``BYTES_PER_PARAM[optimizer]``. Excludes activations and
    ZeRO-3's gathered working set. Raises `ConfigError` if num_params < 1, num_devices < 1, or strategy or
    optimizer is unknown.
    """
    psi = _check_int("num_params", num_params, 1)
    n = _check_int("num_devices", num_devices, 1)
    sb = _check_optimizer(optimizer)
    shard = _shard(psi, n)
    if strategy == "ddp":
        return sb.total * psi
    if strategy == "zero1":
        return (sb.param + sb.grad) * psi + sb.optim * shard
    if strategy == "zero2":
        return sb.param * psi + (sb.grad + sb.optim) * shard
    if strategy == "zero3":
        return sb.total * shard
    raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(trainable parameters, largest single layer) of a torch ``nn.Module``.

    The total counts each trainable (``requires_grad``) parameter once, even if shared. The largest layer is
    the maximum over all submodules of the trainable parameters a module owns directly
    (``parameters(recurse=False)``): the largest unit FSDP/ZeRO-3 gathers when each module is wrapped
    separately; pass it to `plan_memory` as ``largest_layer_params``. Returns (0, 0) for a module without
    trainable parameters. Raises `ConfigError` if `module` is not an ``nn.Module``.
    """
    import torch  # lazy: keeps `import raytrain.memory_plan` fast and torch-free

    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    total = sum(p.numel() for p in module.parameters() if p.requires_grad)
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for m in module.modules()),
        default=0,
    )
    return int(total), int(largest)


def _tp_pp_bytes(psi: int, sb: StateBytes, num_devices: int, tp: int, pp: int) -> int:
    """Megatron-DeepSpeed 3D layout: params and grads split tp*pp ways, optimizer states N ways (ZeRO-1)."""
    return (sb.param + sb.grad) * _shard(psi, tp * pp) + sb.optim * _shard(psi, num_devices)


def plan_memory(
    num_params: int,
    num_devices: int,
    *,
    optimizer: OptimizerKind = "mixed_adam",
    gpu_memory_bytes: int | None = None,
    gpus_per_node: int | None = None,
    reserve_fraction: float = 0.2,
    largest_layer_params: int = 0,
) -> MemoryPlan:
    """Per-device model-state bytes of ddp/zero1/zero2/zero3 and, given device memory, the layout to use.

    Without `gpu_memory_bytes` the plan only holds the byte counts (recommendation ``""``, budget None).
    With it, the budget is ``int(gpu_memory_bytes * (1 - reserve_fraction))`` and the recommendation is the
    first that fits of ddp, zero1, zero2, zero3 (plus its gathered working set (p+g) x largest_layer_params),
    ``tp=<d>`` and ``tp=<d>,pp=<s>`` (see the module docstring), else ``none``. `gpus_per_node` defaults to
    `num_devices` (one node). Raises `ConfigError` unless num_params >= 1, num_devices >= 1, optimizer is
    known, gpu_memory_bytes >= 1, gpus_per_node >= 1 divides num_devices, 0 <= reserve_fraction < 1 and
    0 <= largest_layer_params <= num_params.
    """
    psi = _check_int("num_params", num_params, 1)
    n = _check_int("num_devices", num_devices, 1)
    sb = _check_optimizer(optimizer)
    if gpu_memory_bytes is not None:
        gpu_memory_bytes = _check_int("gpu_memory_bytes", gpu_memory_bytes, 1)
    if gpus_per_node is None:
        gpn = n
    else:
        gpn = _check_int("gpus_per_node", gpus_per_node, 1)
        if n % gpn:
            raise ConfigError(
                f"gpus_per_node must be an integer >= 1 that divides num_devices={n}, got {gpus_per_node!r}"
            )
    if (
        isinstance(reserve_fraction, bool)
        or not isinstance(reserve_fraction, numbers.Real)
        or not 0 <= reserve_fraction < 1
    ):
        raise ConfigError(f"reserve_fraction must be a number in [0, 1), got {reserve_fraction!r}")
    if not _is_int(largest_layer_params) or not 0 <= largest_layer_params <= psi:
        raise ConfigError(
            f"largest_layer_params must be an integer in [0, num_params={psi}], got {largest_layer_params!r}"
        )

    per_device = {s: model_state_bytes(psi, s, n, optimizer) for s in STRATEGIES}
    working_set = (sb.param + sb.grad) * int(largest_layer_params)
    if gpu_memory_bytes is None:
        return MemoryPlan(
            num_params=psi,
            num_devices=n,
            optimizer=optimizer,
            bytes_per_device=per_device,
            recommendation="",
            budget_bytes=None,
            reason="no device memory given; pass gpu_memory_bytes for a recommendation",
            working_set_bytes=working_set,
        )

    budget = int(gpu_memory_bytes * (1 - float(reserve_fraction)))
    rec, reason, rec_bytes = _recommend(psi, n, gpn, sb, per_device, working_set, budget)
    return MemoryPlan(
        num_params=psi,
        num_devices=n,
        optimizer=optimizer,
        bytes_per_device=per_device,
        recommendation=rec,
        budget_bytes=budget,
        reason=reason,
        working_set_bytes=working_set,
        recommended_bytes=rec_bytes,
    )


def _recommend(
    psi: int, n: int, gpn: int, sb: StateBytes, per_device: dict[str, int], working_set: int, budget: int
) -> tuple[str, str, int | None]:
    """(recommendation, one-sentence reason, its per-device bytes) for a budget; see the module docstring."""
    within = f"within the {_gb(budget)} budget"
    ddp = per_device["ddp"]
    if ddp <= budget:
        return "ddp", f"the full model state ({_gb(ddp)} per device) fits {within}; plain DDP suffices", ddp
    for stage, sharded in (("zero1", "optimizer states"), ("zero2", "optimizer states and gradients")):
        need = per_device[stage]
        if need <= budget:
            return (
                stage,
                f"DDP needs {_gb(ddp)} per device; sharding the {sharded} brings it to {_gb(need)}, {within}",
                need,
            )
    zero3 = per_device["zero3"] + working_set
    gathered = (
        f"including a {_gb(working_set)} gathered working set"
        if working_set
        else "(gathered working set unknown, taken as 0)"
    )
    if zero3 <= budget:
        return (
            "zero3",
            f"ZeRO-2 needs {_gb(per_device['zero2'])} per device; sharding the parameters too needs "
            f"{_gb(zero3)} {gathered}, {within}",
            zero3,
        )
    zero3_why = f"ZeRO-3 needs {_gb(zero3)} per device {gathered}, over the {_gb(budget)} budget"
    nodes = n // gpn
    candidates = [(d, 1) for d in _divisors(gpn) if d > 1] + [(gpn, s) for s in _divisors(nodes) if s > 1]
    for d, s in candidates:
        need = _tp_pp_bytes(psi, sb, n, d, s)
        if need <= budget:
            name = f"tp={d}" if s == 1 else f"tp={d},pp={s}"
            layout = f"tensor parallel {d}" + (f" x pipeline {s}" if s > 1 else "")
            return (
                name,
                f"{zero3_why}; {layout} with ZeRO-1 over dp={n // (d * s)} replicas needs {_gb(need)}, {within}",
                need,
            )
    per_param_budget = (budget - working_set) // sb.total
    if per_param_budget >= 1:
        devices = -(-psi // per_param_budget)
        hint = f"ZeRO-3 would fit on {devices} devices of this size"
    else:
        hint = "the gathered working set alone leaves no room for model states; split the largest layer"
    return "none", f"nothing fits: {zero3_why} and no tensor/pipeline layout fits either; {hint}", None


def format_memory_table(plan: MemoryPlan) -> str:
    """A human-readable table of `plan`: strategy, GB per device, whether it fits the budget (when known,
    zero3 including its gathered working set), then ``recommendation: <name> (<reason>)``."""
    header = f"{'strategy':<9} {'GB/device':>10}"
    if plan.budget_bytes is not None:
        header += f"  fits {plan.budget_bytes / GB:.3g} GB budget?"
    lines = [header]
    for strategy, num_bytes in plan.bytes_per_device.items():
        row = f"{strategy:<9} {num_bytes / GB:>10.3g}"
        if plan.budget_bytes is not None:
            extra = plan.working_set_bytes if strategy == "zero3" else 0
            row += "  " + ("yes" if num_bytes + extra <= plan.budget_bytes else "no")
            if extra:
                row += f" (+{extra / GB:.3g} GB gathered working set)"
        lines.append(row)
    lines.append(f"recommendation: {plan.recommendation or '-'} ({plan.reason})")
    return "\n".join(lines)


# ---------------------------------------------------------------- what raytrain's loop holds


@dataclass(frozen=True)
class LoopMemory:
    """Bytes one rank holds at the peak of an optimizer step of raytrain's loop, by kind (see `loop_memory`).

    `parts` maps a kind to its bytes: params (fp32 masters, or their shards), grads (whole for DDP, shards for
    FSDP), optimizer (states), gathered (FSDP's unsharded parameters alive at once), unit_transient
    (what FSDP allocates around one unit's backward: its unsharded gradient and reduce-scatter buffer, and for
    zero3 the unit's and the prefetched unit's gathered parameters), grad_cast (zero2 in bf16/fp16: the unit's
    gradient cast to fp32 for its reduce-scatter), accumulated_grads (the whole gradient held
    between micro-steps), cast (autocast's low-precision weight copies). Activations are not counted: they depend
    on the model and the micro-batch.
    """

    strategy: str
    world_size: int
    accumulation_steps: int
    grad_accumulation: str
    precision: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        """The peak bytes: the sum of the parts."""
        return sum(self.parts.values())


def loop_memory(
    num_params: int,
    strategy: str,
    world_size: int,
    *,
    largest_unit_params: int = 0,
    root_unit_params: int | None = None,
    optimizer_bytes_per_param: int = 8,
    accumulation_steps: int = 1,
    grad_accumulation: str = "unsharded",
    precision: str = "fp32",
) -> LoopMemory:
    """Peak per-rank bytes of raytrain's implementation of `strategy` (not the ZeRO paper's idealisation), with
    fp32 master weights and gradients, o = `optimizer_bytes_per_param` (AdamW 8), c the compute dtype's bytes (4
    for fp32, 2 for bf16/fp16), U the largest FSDP unit, R the root unit (what no block claims; default U) and
    Ψ/W rounded up:

        ddp    params 4Ψ + grads 4Ψ (views of DDP's buckets: no second copy) + optimizer oΨ (+ cΨ autocast
               copies, c < 4); at W > 1 the first step holds the gradients twice (autograd's and the buckets)
               before the optimizer's state exists, so the peak is 8Ψ + max(4Ψ, optimizer): + (4Ψ - optimizer)
               where the state is smaller than 4Ψ (`ddp_first_step`: sgd, or zero1 at W > 2 with AdamW)
        zero1  the same with the optimizer state oΨ/W (AdamW: 12Ψ at W >= 2, the first step's peak)
        zero2  shards (4 + o)Ψ/W + every unit gathered cΨ + (c + 4)U around one unit's backward
               (+ 4U when c < 4: FSDP2 casts the unit's gradient to fp32, its reduce dtype, beside the
               reduce-scatter's input buffer)
               + while accumulating (k > 1): gradient shards 4Ψ/W (sharded) or the whole gradient 4Ψ (unsharded)
        zero3  shards (4 + o)Ψ/W + (3c + 4)U around one unit's backward + cR (FSDP2 keeps the root gathered
               from its forward to the end of the backward); (3c + 4)U is, in fp32, the unit's gathered parameters,
               the prefetched unit's, its unsharded gradient and the reduce-scatter buffer; measured in bf16 the
               peak holds instead the unit's parameters, its gradient cast to fp32 and the reduce-scatter input,
               (c + 8)U, equal to (3c + 4)U at c = 2 only
               + gradient shards 4Ψ/W, or the whole gradient 4Ψ while accumulating unsharded (k > 1)
        both, accumulating sharded (k > 1): + 4U/W, the unit's new gradient shard (FSDP2's reduce-scatter
               output) beside the shard it is then added to

    zero2's peak is at the start of the backward, when every unit is still gathered and gradient shards are not
    yet produced (accumulating sharded: in a later micro-step's reduce-scatter, the earlier shards held); zero3's
    at the end, when the gradient shards are complete. At W = 1 nothing is wrapped or sharded: params, grads and
    optimizer state only. Measured against real allocations in `benchmarks/memory.py`. Raises `ConfigError` for
    values out of range.
    """
    psi = _check_int("num_params", num_params, 1)
    w = _check_int("world_size", world_size, 1)
    unit = min(_check_int("largest_unit_params", largest_unit_params, 0), psi)
    root = unit if root_unit_params is None else min(_check_int("root_unit_params", root_unit_params, 0), psi)
    o = _check_int("optimizer_bytes_per_param", optimizer_bytes_per_param, 0)
    k = _check_int("accumulation_steps", accumulation_steps, 1)
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if grad_accumulation not in ("unsharded", "sharded"):
        raise ConfigError(f"grad_accumulation must be unsharded or sharded, got {grad_accumulation!r}")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"precision must be one of fp32, bf16, fp16, got {precision!r}")
    c = 4 if precision == "fp32" else 2
    parts: dict[str, int]
    if w == 1 or strategy in ("ddp", "zero1"):
        parts = {"params": 4 * psi, "grads": 4 * psi}
        parts["optimizer"] = o * (_shard(psi, w) if strategy == "zero1" else psi)
        if w > 1 and parts["optimizer"] < 4 * psi:  # the first step's second gradient copy outgrows the state
            parts["ddp_first_step"] = 4 * psi - parts["optimizer"]
        if c != 4:
            parts["cast"] = c * psi
        return LoopMemory(strategy, w, k, grad_accumulation, precision, parts)
    shard = _shard(psi, w)
    parts = {"params": 4 * shard, "optimizer": o * shard}
    accumulating_whole = k > 1 and grad_accumulation == "unsharded"
    if strategy == "zero2":
        parts["gathered"] = c * psi
        parts["unit_transient"] = (c + 4) * unit
        if c != 4:
            parts["grad_cast"] = 4 * unit
        if accumulating_whole:
            parts["accumulated_grads"] = 4 * psi
        elif k > 1:
            parts["grads"] = 4 * shard
    else:
        parts["unit_transient"] = (3 * c + 4) * unit + c * root
        if accumulating_whole:
            parts["accumulated_grads"] = 4 * psi
        else:
            parts["grads"] = 4 * shard
    if k > 1 and not accumulating_whole:
        parts["new_grad_shard"] = 4 * _shard(unit, w)
    return LoopMemory(strategy, w, k, grad_accumulation, precision, parts)
