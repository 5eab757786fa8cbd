"""The one decision per matrix: which layer serves each linear product of a model, and why.

`Planner.plan(weight, bias, role)` is called once for every matrix while a model is built (engine/models/model.py's
`build_model`); nothing changes a layer afterwards. What it weighs:
- the weight as the checkpoint holds it: float, or codes from a GGUF's blocks (group codes, or Q4_K's super-block
  codes; their `served` says which type, and whether as stored or fitted at load);
- the policy: `quantize` (auto/none: float weights stay dense and codes are served as they come; int4/int8:
  float weights quantized at load, the LM head in int8 rows under int4, since 4-bit logits flip greedy answers),
  and `dense_copies` (quantized block layers also keep a dense copy for many rows);
- the machine (`Machine`): the device, whether kvserve's own kernels run, whether the CPU computes in bfloat16
  and whether oneDNN packs bfloat16 weights;
- what was measured on this machine (`Timings`, one record per machine): the kernels' product forms, and the
  row count from which a dense form beats the codes (the tied LM head, dense copies).

Every decision carries its reason; the engine logs them at start and `/info` reports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.linear.codes import QUANTIZED, GroupCodes, QuantizedWeight, StackedCodes, SubBlockCodes, SuperBlockCodes
from engine.linear.embedding import ROW_READABLE, CodesEmbedding
from engine.linear.dense import WEIGHT_LEFT_MIN_ELEMENTS, CpuLinear, PackedLinear, packs_bfloat16
from engine.linear.quantized import (Codes4Linear, Codes5Linear, Codes8Linear, GroupLinear, Int8Linear, StackedLinear,
                                    SubBlock6Linear, SuperBlockLinear, WeightOnlyLinear)
from engine.linear.timing import ProductForms, Timings, measure_forms, measure_switch
from engine.linear.two_forms import TwoForms, dense_weight

QUANTIZE_MODES = ("auto", "none", "int4", "int8")


@dataclass(frozen=True)
class Machine:
    """What the planner knows of where the model runs, read once when a model is built."""

    device: torch.device
    kernels_off: str | None = "not read"  # why kvserve's own kernels cannot run here; None where they run
    native_bfloat16: bool = False  # the CPU computes in bfloat16 (AVX512-BF16 or AMX)
    packs_bfloat16: bool = False  # oneDNN computes bfloat16 products over prepacked weights

    @classmethod
    def found(cls, device: torch.device) -> "Machine":
        if device.type != "cpu":
            return cls(device, kernels_off=f"they run on the CPU, not {device.type}")
        from engine.device import cpu_has_native_bf16
        from engine.linear.native import load_kernels

        return cls(device, load_kernels(), cpu_has_native_bf16(), packs_bfloat16())

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"


@dataclass(frozen=True)
class Role:
    """Where a matrix sits: its name in the model, and for the LM head of a tied model, the embedding it shares."""

    name: str  # "layers.3.mlp.down_proj", "lm_head"
    tied_embedding: torch.Tensor | None = field(default=None, compare=False)

    @property
    def head(self) -> bool:
        return self.name == "lm_head"


@dataclass(frozen=True, eq=False)
class Decision:
    name: str
    layer: nn.Module
    reason: str
    served: tuple[str, ...] = ()  # the weight's sources and how they are held (GroupCodes.served)

    @property
    def kind(self) -> str:
        """The layer's class; for two forms, both: "TwoForms(Codes4Linear, CpuLinear)"."""
        if isinstance(self.layer, TwoForms):
            return f"TwoForms({type(self.layer.codes).__name__}, {type(self.layer.dense).__name__})"
        return type(self.layer).__name__


class Planner:
    def __init__(self, machine: Machine, quantize: str = "none", dense_copies: bool = False,
                 timings: Timings | None = None):
        if quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {quantize!r}")
        self.machine = machine
        self.quantize = quantize
        self.dense_copies = dense_copies and machine.cpu
        self.timings = timings if timings is not None else Timings(None)
        self._forms: ProductForms | None = None

    @classmethod
    def for_machine(cls, device: torch.device, quantize: str = "none", dense_copies: bool = False) -> "Planner":
        """The planner for the machine found, with its record of what was measured here."""
        from engine.linear.native import kernels_library

        machine = Machine.found(device)
        timings = Timings.for_machine(kernels_library() if machine.kernels_off is None else None)
        return cls(machine, quantize, dense_copies, timings)

    def plan(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, role: Role) -> Decision:
        """The layer that serves `weight` (out, in) in `role`, and why."""
        if not self.machine.cpu:
            return Decision(role.name, plain_linear(weight, bias), f"dense on {self.machine.device.type}: torch's product")
        if isinstance(weight, torch.Tensor) and self.quantize in ("int4", "int8"):
            if self.quantize == "int8" or role.head:
                why = "quantize=int8" if self.quantize == "int8" else "quantize=int4 keeps the head in 8 bits: 4-bit logits flip greedy answers"
                codes = Int8Linear(weight, convert(bias), torch.bfloat16)
                return self._with_dense_form(codes, role, f"int8 rows quantized at load ({why})", ())
            codes, how = self._codes_layer(GroupCodes.fit(weight, 4), convert(bias), role.head)
            return self._with_dense_form(codes, role, f"int4 groups quantized at load (quantize=int4): {how}", ())
        if isinstance(weight, (SuperBlockCodes, SubBlockCodes, StackedCodes)) and self.machine.kernels_off is not None:
            weight = weight.group_codes()  # torch's kernel takes groups
        if isinstance(weight, QUANTIZED):
            codes, how = self._codes_layer(weight, convert(bias), role.head)
            why = how if isinstance(weight, StackedCodes) else f"{'; '.join(weight.served)}: {how}"  # a stack names its parts
            return self._with_dense_form(codes, role, why, weight.served)
        layer, how = self._dense_layer(weight, bias, packable=weight is not role.tied_embedding)
        return Decision(role.name, layer, how)

    def _codes_layer(self, weight: QuantizedWeight, bias: torch.Tensor | None, head: bool) -> tuple[WeightOnlyLinear, str]:
        output = torch.float32 if head else torch.bfloat16  # logits are float32
        if isinstance(weight, StackedCodes):
            layers, hows = zip(*(self._codes_layer(p, None, head) for p in weight.parts))
            parts = "; ".join(f"{', '.join(p.served)} on {how}" for p, how in zip(weight.parts, hows))
            return StackedLinear(list(layers), bias), f"stacked by type: {parts}"
        if isinstance(weight, (SuperBlockCodes, SubBlockCodes)):
            # Integer tiles for whole 16 rows alone (the rest dot products), from where they win for group codes:
            # no bfloat16 tiles, which would give a row other bits than it gets alone.
            forms = ProductForms(integer_tiles_from=max(self.forms.integer_tiles_from, SuperBlockLinear.TILE))
            if isinstance(weight, SubBlockCodes):
                return SubBlock6Linear(weight, bias, output, forms), f"kvserve's Q6_K kernel ({forms.described()})"
            return SuperBlockLinear(weight, bias, output, forms), f"kvserve's Q{weight.bits}_K kernel ({forms.described()})"
        kind = codes_layer_class(weight.bits, self.machine)
        if kind is GroupLinear:
            halves = f" ({weight.bits} bits as two 4-bit halves)" if weight.bits > 4 else ""
            return GroupLinear(weight, bias), f"torch's int4 kernel{halves} (kvserve's kernels are off here: {self.machine.kernels_off})"
        forms = self.forms
        return kind(weight, bias, output, forms), f"kvserve's {weight.bits}-bit kernel ({forms.described()})"

    def _dense_class(self, dtype: torch.dtype, packable: bool) -> type[nn.Module]:
        return PackedLinear if dtype == torch.bfloat16 and self.machine.packs_bfloat16 and packable else CpuLinear

    def _dense_layer(self, weight: torch.Tensor, bias: torch.Tensor | None, packable: bool) -> tuple[nn.Module, str]:
        if self._dense_class(weight.dtype, packable) is PackedLinear:
            return PackedLinear(weight, bias), "dense bfloat16, prepacked by oneDNN (it computes in bfloat16 here)"
        widen = not self.machine.native_bfloat16
        layer = CpuLinear(as_parameter(weight), None if bias is None else as_parameter(bias), widen_bfloat16=widen)
        if weight.dtype == torch.float32:
            if weight.numel() >= WEIGHT_LEFT_MIN_ELEMENTS:
                return layer, "dense float32: W·xᵀ through MKL's GEMM up to 128 rows"
            return layer, "dense float32: F.linear (too small for W·xᵀ to pay)"
        tied = "" if packable else ", the embedding itself (packing would copy it)"
        if weight.dtype == torch.bfloat16 and widen:
            return layer, f"dense bfloat16{tied}, widened to float32 from 64 rows (no bfloat16 arithmetic on this CPU)"
        return layer, f"dense {dtype_name(weight.dtype)}{tied}: F.linear"

    def _with_dense_form(self, codes: WeightOnlyLinear, role: Role, how: str, served: tuple[str, ...]) -> Decision:
        """The codes alone, or TwoForms with a dense form from the row count measured: the tied head's embedding
        where its codes cannot serve the lookups (a packed copy of it with dense copies), or with dense copies a
        block layer's own copy."""
        if role.head and role.tied_embedding is not None:
            if isinstance(codes, ROW_READABLE) and not self.dense_copies:
                # A decode step takes the codes at any row count (TwoForms), so the dense form would serve only
                # prefill's head over many rows (prompt scoring): not worth a dense table of the vocabulary beside
                # codes that serve the lookups too (SmolLM2: 57 MB, 8% of its server). dense_copies buys it back.
                return Decision(role.name, codes, f"{how}; codes at every row count (the embedding reads its rows from "
                                "them: no dense table held for prompt scoring alone)", served)
            embedding = role.tied_embedding
            dense, _ = self._dense_layer(embedding, codes.bias, packable=self.dense_copies)
            switch = self.switch(codes, dense, f"head {type(codes).__name__} {shape(codes)} vs embedding {type(dense).__name__}")
            if switch is None and isinstance(dense, PackedLinear):  # a copy that never runs would only take memory
                dense, _ = self._dense_layer(embedding, codes.bias, packable=False)
            name = "packed embedding" if isinstance(dense, PackedLinear) else "embedding"
            if switch is None:  # the embedding is no form of the head: `embedding` may then read its rows from the codes
                return Decision(role.name, codes, f"{how}; codes at every row count (measured)", served)
            return Decision(role.name, TwoForms(codes, dense, switch),
                            f"{how}; codes below {switch} rows, the {name} from there (measured)", served)
        if self.dense_copies and not role.head:
            # The record is read before any copy is made: where it says the codes win at every row count, none is.
            copies: list[nn.Module] = []

            def measured() -> dict[int, tuple[float, float]]:
                copies.append(self._dense_layer(dense_weight(codes), codes.bias, packable=True)[0])
                return measure_switch(codes, copies[0])

            kind = self._dense_class(codes.activation_dtype, packable=True).__name__
            switch = self.timings.switch(f"block {type(codes).__name__} {shape(codes)} vs copy {kind}", measured)
            if switch is not None:
                dense = copies[0] if copies else self._dense_layer(dense_weight(codes), codes.bias, packable=True)[0]
                return Decision(role.name, TwoForms(codes, dense, switch),
                                f"{how}; codes below {switch} rows, a dense copy from there (measured)", served)
            how += "; no dense copy: the codes were faster at every row count (measured)"
        return Decision(role.name, codes, how, served)

    def embedding(self, weight: torch.Tensor | QuantizedWeight, head: Decision | None, dtype: torch.dtype) -> Decision:
        """The token embedding (vocab, hidden): dense, or codes where an untied GGUF stores it quantized; `head`: the
        LM head's decision where the two are tied; `dtype`: what the blocks compute in. Lookups read codes wherever
        codes that read their rows back hold the table (the tied head's, or the embedding's own): the table is then
        held once, as stored; otherwise the dense table (it is then also the head, or a form of it)."""
        if isinstance(weight, QUANTIZED):
            return self._own_codes_embedding(weight, dtype)
        layer = head.layer if head is not None else None
        if isinstance(layer, TwoForms) and isinstance(layer.dense, PackedLinear):
            layer = layer.codes  # its dense form is a packed copy: the table itself serves only the lookups
        if isinstance(layer, ROW_READABLE):
            return Decision("embed_tokens", CodesEmbedding(layer, dtype),
                            f"rows of the LM head's codes, dequantized at lookup to {dtype_name(dtype)}: "
                            "no dense table beside them")
        if head is None:
            why = "the checkpoint's own table (not tied to the head)"
        elif isinstance(layer, WeightOnlyLinear):
            why = f"the head's {type(layer).__name__} codes do not read their rows back"
        elif isinstance(layer, TwoForms):
            why = f"also the LM head's dense form, from {layer.dense_from} rows"
        else:
            why = "also the LM head"
        return Decision("embed_tokens", dense_embedding(weight), f"dense {dtype_name(weight.dtype)}: {why}")

    def _own_codes_embedding(self, weight: QuantizedWeight, dtype: torch.dtype) -> Decision:
        """An untied table stored quantized: its rows read from a codes layer of its own (whose product never runs),
        where kvserve's kernels hold that type; else dequantized once into a dense table."""
        if self.machine.cpu and self.machine.kernels_off is None and not isinstance(weight, StackedCodes):
            codes, _ = self._codes_layer(weight, None, head=False)
            if isinstance(codes, ROW_READABLE):
                return Decision("embed_tokens", CodesEmbedding(codes, dtype),
                                f"{'; '.join(weight.served)}: its own codes, rows dequantized at lookup to "
                                f"{dtype_name(dtype)}", weight.served)
            why = f"{type(codes).__name__} codes do not read their rows back"
        else:
            why = "kvserve's kernels are off here" if self.machine.cpu else f"on {self.machine.device.type}"
        return Decision("embed_tokens", dense_embedding(weight.dequantize().to(dtype)),
                        f"dense {dtype_name(dtype)}: the stored codes dequantized at load ({why})")

    @property
    def forms(self) -> ProductForms:
        """The kernels' forms on this machine: recorded, or measured once and recorded."""
        if self._forms is None:
            self._forms = self.timings.forms(measure_forms)
        return self._forms

    def switch(self, codes: nn.Module, dense: nn.Module, key: str) -> int | None:
        return self.timings.switch(key, lambda: measure_switch(codes, dense))


def codes_layer_class(bits: int, machine: Machine) -> type[WeightOnlyLinear]:
    """The layer that serves group codes of `bits` there: kvserve's kernels where they run, else torch's."""
    if machine.kernels_off is None:
        return {4: Codes4Linear, 5: Codes5Linear, 8: Codes8Linear}[bits]
    return GroupLinear


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding exactly these tensors (no initialisation)."""
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = as_parameter(weight)
    if bias is not None:
        layer.bias = as_parameter(bias)
    return layer


def dense_embedding(weight: torch.Tensor) -> nn.Embedding:
    """An nn.Embedding holding exactly this table (no initialisation)."""
    with torch.device("meta"):  # made uninitialized, as Transformer makes its own (engine/models/model.py)
        layer = nn.Embedding(*weight.shape, _weight=torch.empty(weight.shape))
    layer.weight = as_parameter(weight)
    return layer


def as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


def convert(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A quantized layer's bias, in the bfloat16 its products come in."""
    return None if bias is None else bias.to(torch.bfloat16)


def shape(layer: nn.Module) -> str:
    return f"{layer.out_features}x{layer.in_features}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def summary(decisions: list[Decision]) -> list[dict]:
    """The decisions grouped: blocks' matrices of the same name, layer and reason as one entry ("layers.*.mlp.down_proj")."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for d in decisions:
        pattern = re.sub(r"^layers\.\d+\.", "layers.*.", d.name)
        grouped.setdefault((pattern, d.kind, d.reason), []).append(d.name)
    return [{"matrices": pattern, "count": len(names), "layer": kind, "reason": reason}
            for (pattern, kind, reason), names in grouped.items()]


def served_by_type(decisions: list[Decision]) -> dict[str, dict[str, int]]:
    """How the matrices of each GGUF type are served, with their counts: {"Q4_K": {"as stored": 96}, "Q6_K":
    {"as stored": 9, "fitted to 8-bit groups at load": 8}} (a fused layer counts once for each source in it)."""
    out: dict[str, dict[str, int]] = {}
    for d in decisions:
        for served in d.served:
            kind, _, how = served.partition(" ")
            out.setdefault(kind, {}).setdefault(how, 0)
            out[kind][how] += 1
    return out
