"""Finding the decoder stack inside a (possibly wrapped) target model.

vLLM and HF nest the decoder layers differently: `model.model.layers` (Llama, Qwen,
DeepseekV3), `model.language_model.model.layers` (Kimi-K2.5's
KimiK25ForConditionalGeneration around a DeepseekV3ForCausalLM), `get_language_model()`
on vLLM multimodal models, `model.transformer.h` + `ln_f` (GPT-2 style). The resolver
walks the known paths, checks that it found a non-empty list of layers next to a final
norm, and when nothing fits names every path it tried and the classes it saw.

Layer ids (the vLLM convention, used everywhere in this project): id k is the hidden
state ENTERING decoder layer k; id N (N = number of layers) is the last layer's output
before the final norm. Default aux ids for N layers: [2, N//2, N-3].
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# attribute paths from a root module to the ModuleList of decoder layers
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
NORM_NAMES = ("norm", "final_norm", "ln_f", "final_layernorm", "norm_f", "final_layer_norm")


class DecoderStackNotFound(LookupError):
    """No known path leads to decoder layers plus a final norm."""


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


def _roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    roots = [("", model)]
    get_lm = getattr(model, "get_language_model", None)
    if callable(get_lm):
        try:
            language_model = get_lm()
        except (AttributeError, NotImplementedError):
            language_model = None
        if isinstance(language_model, nn.Module) and language_model is not model:
            roots.append(("get_language_model().", language_model))
    return roots


def resolve_decoder_stack(model: nn.Module) -> DecoderStack:
    """Return the decoder layers, final norm and path of `model`, or raise naming what was tried."""
    tried: list[str] = []
    for prefix, root in _roots(model):
        for path in LAYER_PATHS:
            layers = _walk(root, path)
            owner_path = path.rsplit(".", 1)[0] if "." in path else ""
            owner = _walk(root, owner_path) if owner_path else root
            if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
                tried.append(f"{prefix}{path} (not found)" if layers is None else f"{prefix}{path} ({type(layers).__name__})")
                continue
            norm = next((getattr(owner, n) for n in NORM_NAMES if isinstance(getattr(owner, n, None), nn.Module)), None)
            if norm is None:
                tried.append(f"{prefix}{path} (layers found on {type(owner).__name__}, but no final norm among {list(NORM_NAMES)})")
                continue
            assert isinstance(owner, nn.Module)
            return DecoderStack(inner=owner, layers=layers, norm=norm, path=f"{prefix}{path}")
    children = {name: type(child).__name__ for name, child in model.named_children()}
    raise DecoderStackNotFound(
        f"cannot find the decoder layers of {type(model).__name__} (children: {children}); "
        f"tried: {'; '.join(tried)}. Add the path to eagle3.capture.layers.LAYER_PATHS if this model nests them elsewhere."
    )
