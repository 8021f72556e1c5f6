"""Finding the decoder stack inside a (possibly wrapped) target model.

vLLM and HF nest the decoder layers differently: `model.model.layers` (Llama, Qwen,
DeepseekV3), `model.language_model.model.layers` (Kimi-K2.5's
KimiK25ForConditionalGeneration around a DeepseekV3ForCausalLM), `get_language_model()`
on vLLM multimodal models, `model.transformer.h` + `ln_f` (GPT-2 style), and new families
keep inventing others. So the resolver works in two steps:

1. the known paths (LAYER_PATHS), a fast first try that never needs a tree walk;
2. a structural search: every non-empty nn.ModuleList in the tree (and in
   `get_language_model()`'s tree) that is followed, on the same owner module, by a final
   norm (a child named like one, or whose class name contains "Norm", registered after the
   list). A list alone in a thin container (PLaMo 3's `model.layers.layers`) takes the norm
   that follows the container on its parent, which is then the inner module. Lists nested
   inside another candidate's layers (MoE experts) do not count.
   Hybrid stacks (linear attention or Mamba layers between attention layers, of different
   classes in one list) are one stack: id k is the state entering layer k of that list.
   Several candidates left (a vision tower and a language model, say) are narrowed to the
   language model (`get_language_model()`, or a path naming `language_model`/`text`);
   if that does not leave exactly one, the resolver refuses and names every candidate:
   picking one silently would extract the wrong model's states.

When nothing fits, the error names every path tried and the classes seen.

Layer ids (the vLLM convention, used everywhere in this project): id k is the hidden
state ENTERING decoder layer k; id N (N = number of layers) is the last layer's output
before the final norm. Default aux ids for N layers: [2, N//2, N-3].
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# attribute paths from a root module to the ModuleList of decoder layers (tried first, in order)
LAYER_PATHS = (
    "model.layers",
    "language_model.model.layers",
    "model.language_model.layers",
    "language_model.layers",
    "transformer.h",
    "model.decoder.layers",
    "layers",
)
# names of the final norm on the module that owns the layers
NORM_NAMES = ("norm", "final_norm", "ln_f", "final_layernorm", "norm_f", "final_layer_norm", "norm_out")
# path segments that mark the language model among several candidate stacks
TEXT_HINTS = ("language_model", "text")


class DecoderStackNotFound(LookupError):
    """No known path and no structural candidate leads to decoder layers plus a final norm."""


class AmbiguousDecoderStack(DecoderStackNotFound):
    """Several candidate stacks, and nothing says which one is the language model."""


@dataclass(frozen=True)
class DecoderStack:
    """The inner transformer: its layers, its final norm, and where they were found."""

    inner: nn.Module  # the module that owns `layers` and the final norm; its forward is patched
    layers: nn.ModuleList
    norm: nn.Module
    path: str  # e.g. "language_model.model.layers"

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _walk(root: nn.Module, path: str) -> object | None:
    node: object = root
    for name in path.split("."):
        node = getattr(node, name, None)
        if node is None:
            return None
    return node


def _language_model(model: nn.Module) -> nn.Module | None:
    get_lm = getattr(model, "get_language_model", None)
    if not callable(get_lm):
        return None
    try:
        language_model = get_lm()
    except (AttributeError, NotImplementedError):
        return None
    return language_model if isinstance(language_model, nn.Module) and language_model is not model else None


def _roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    language_model = _language_model(model)
    return [("", model)] + ([("get_language_model().", language_model)] if language_model is not None else [])


def _is_norm(name: str, module: object) -> bool:
    return isinstance(module, nn.Module) and (name in NORM_NAMES or "Norm" in type(module).__name__)


def final_norm(owner: nn.Module, list_name: str, *, named_anywhere: bool = True) -> nn.Module | None:
    """The final norm of `owner.<list_name>`: a norm-like child registered after the list;
    with `named_anywhere` (known paths only), else a child named one of NORM_NAMES wherever it sits."""
    names = [name for name, _ in owner.named_children()]
    after = names[names.index(list_name) + 1:] if list_name in names else []
    # a final-norm name first (Gemma 4 registers a per_layer_projection_norm too), then any *Norm class
    found = next((getattr(owner, n) for n in NORM_NAMES if n in after), None)
    found = found or next((getattr(owner, n) for n in after if _is_norm(n, getattr(owner, n))), None)
    if found is None and named_anywhere:
        found = next((getattr(owner, n) for n in NORM_NAMES if isinstance(getattr(owner, n, None), nn.Module)), None)
    return found


def _known_path(model: nn.Module, tried: list[str]) -> DecoderStack | None:
    for prefix, root in _roots(model):
        for path in LAYER_PATHS:
            layers = _walk(root, path)
            owner_path, _, list_name = path.rpartition(".")
            owner = _walk(root, owner_path) if owner_path else root
            if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or not isinstance(owner, nn.Module):
                tried.append(f"{prefix}{path} (not found)" if layers is None else f"{prefix}{path} ({type(layers).__name__})")
                continue
            norm = final_norm(owner, list_name)
            if norm is None:
                tried.append(f"{prefix}{path} (layers found on {type(owner).__name__}, but no final norm among {list(NORM_NAMES)})")
                continue
            return DecoderStack(inner=owner, layers=layers, norm=norm, path=f"{prefix}{path}")
    return None


def _candidates(model: nn.Module, seen_lists: list[str]) -> list[DecoderStack]:
    """Every ModuleList with a final norm after it, outermost only, paths from the model where reachable."""
    found: dict[int, DecoderStack] = {}
    for prefix, root in _roots(model):
        modules = dict(root.named_modules())
        for owner_path, owner in modules.items():
            for name, child in owner.named_children():
                if not isinstance(child, nn.ModuleList) or len(child) == 0 or id(child) in found:
                    continue
                if all(_is_norm("", m) for m in child):  # per-layer norms, not layers
                    continue
                path = f"{prefix}{owner_path}.{name}" if owner_path else f"{prefix}{name}"
                inner, norm = owner, final_norm(owner, name, named_anywhere=False)
                if norm is None and owner_path and len(list(owner.children())) == 1:  # a thin container (Plamo3Decoder)
                    parent_path, _, owner_name = owner_path.rpartition(".")
                    parent = modules.get(parent_path)
                    if parent is not None:
                        inner, norm = parent, final_norm(parent, owner_name, named_anywhere=False)
                classes = sorted({type(m).__name__ for m in child})
                seen_lists.append(f"{path} ({len(child)} x {'/'.join(classes)}{'' if norm else ', no final norm'})")
                if norm is not None:
                    found[id(child)] = DecoderStack(inner=inner, layers=child, norm=norm, path=path)
    inside = {id(m) for stack in found.values() for layer in stack.layers for m in layer.modules()}
    return [stack for stack in found.values() if id(stack.layers) not in inside]


def _pick_language_model(model: nn.Module, candidates: list[DecoderStack]) -> list[DecoderStack]:
    """Narrow several candidates to the language model's, by get_language_model() first, then by name."""
    language_model = _language_model(model)
    if language_model is not None:
        members = {id(m) for m in language_model.modules()}
        narrowed = [c for c in candidates if id(c.layers) in members]
        if narrowed:
            return narrowed
    named = [c for c in candidates if any(h in seg for seg in c.path.split(".") for h in TEXT_HINTS)]
    return named or candidates


def resolve_decoder_stack(model: nn.Module) -> DecoderStack:
    """Return the decoder layers, final norm and path of `model`, or raise naming what was tried."""
    tried: list[str] = []
    stack = _known_path(model, tried)
    if stack is not None:
        return stack
    seen_lists: list[str] = []
    candidates = _candidates(model, seen_lists)
    if len(candidates) > 1:
        candidates = _pick_language_model(model, candidates)
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        listed = "; ".join(f"{c.path} ({c.num_layers} x {type(c.layers[0]).__name__}, norm {type(c.norm).__name__})" for c in candidates)
        raise AmbiguousDecoderStack(
            f"{type(model).__name__} has {len(candidates)} candidate decoder stacks and nothing says which is the "
            f"language model: {listed}. Refusing to pick one; add the language model's path to "
            "eagle3.capture.layers.LAYER_PATHS (known paths are tried first), or give the wrapper a "
            "get_language_model() that returns the text model."
        )
    children = {name: type(child).__name__ for name, child in model.named_children()}
    raise DecoderStackNotFound(
        f"cannot find the decoder layers of {type(model).__name__} (children: {children}); "
        f"tried: {'; '.join(tried)}; ModuleLists seen: {'; '.join(seen_lists) or 'none'}. "
        "Add the path to eagle3.capture.layers.LAYER_PATHS if this model nests them elsewhere "
        f"(its owner needs a final norm named one of {list(NORM_NAMES)} or of a *Norm class)."
    )
