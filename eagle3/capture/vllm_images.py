"""Prompts with images for vLLM: token ids plus `multi_modal_data`, and the ids the engine runs for them.

Moved out of eagle3.capture.vllm_adapter (one concept: what a prompt with images looks like to vLLM 0.32). A prompt
carries its images in the modality the model's processor takes (Kimi-K2.5's `vision_chunk` items, else `image`);
`expand_prompts` gives the token ids as the engine sees them, each image placeholder expanded by vLLM's own
multimodal processor through `LLM._preprocess_cmpl` (vLLM 0.32's, a private method). Nothing here loads an engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from eagle3.capture.vllm_versions import VllmUnsupported

Images = Sequence[Sequence[str]]  # per prompt, the URLs of its images in placeholder order (eagle3.data.images)


def token_prompts(llm, prompts: Sequence[Sequence[int]], images: Images | None) -> list[object]:  # noqa: ANN001
    """vLLM TokensPrompts: token ids, and a prompt's images as `multi_modal_data` where it has any."""
    from vllm.inputs import TokensPrompt

    if not images or not any(images):
        return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    from eagle3.data.images import load_image

    modality = _image_modality(llm)
    out = []
    for ids, urls in zip(prompts, images, strict=True):
        prompt = TokensPrompt(prompt_token_ids=list(ids))
        if urls:
            pictures = [load_image(u) for u in urls]
            prompt["multi_modal_data"] = {modality: [{"type": "image", "image": p, "uuid": None} for p in pictures]
                                          if modality == "vision_chunk" else pictures}
        out.append(prompt)
    return out


def _image_modality(llm) -> str:  # noqa: ANN001 - vllm.LLM
    """The multimodal data key the model's processor takes images under ("vision_chunk": Kimi-K2.5's, else "image")."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    limits = MULTIMODAL_REGISTRY.get_processing_info(llm.llm_engine.vllm_config.model_config).get_supported_mm_limits()
    if "image" in limits:
        return "image"
    if "vision_chunk" in limits:
        return "vision_chunk"
    raise VllmUnsupported(f"the target's multimodal processor takes {sorted(limits)}, no images; remove the images "
                          "from the data")


def expand_prompts(llm, prompts: Sequence[Sequence[int]], images: Images) -> list[list[int]]:  # noqa: ANN001
    """The token ids the engine runs for `prompts` with `images`: vLLM's multimodal processor expands each image
    placeholder to one position per image token (the same call `generate` makes first)."""
    preprocess = getattr(llm, "_preprocess_cmpl", None)
    if preprocess is None:
        import vllm

        raise VllmUnsupported(f"vLLM {vllm.__version__} has no LLM._preprocess_cmpl, which image capture uses to learn "
                              "the ids the engine runs; capture data with images on the pinned vLLM (0.32)")
    return [list(e["prompt_token_ids"]) for e in preprocess(token_prompts(llm, prompts, images))]
