"""Vision-language models: any transformers image-text-to-text model (``AutoModelForImageTextToText`` with its
``AutoProcessor``: LLaVA, PaliGemma, Qwen2-VL, Idefics/SmolVLM, BLIP-2 with a decoder-only or an encoder-decoder
language model, …) from a hub name or a local folder, fine-tuned with LoRA through peft.

The base model is frozen; LoRA adapters (:class:`~gx_ray.models.lora.LoraSettings`) train on the language model's
projections (:data:`VLM_LORA`), the vision tower's too with ``lora_vision``; ``train_vision`` / ``train_language`` open
either whole. A question goes in with its images through the model's own chat template (else the processor's plain
prompt); the answer is taught by cross-entropy on its tokens only; with ``packing`` (LLaVA only: :func:`check_packing`)
the taught batch is one unpadded row, samples told apart by position ids restarting at 0. With ``stack_views`` a
question's views are one multi-channel image (:func:`widen_patch_embedding`), the paper's adaptation of 2D VLMs to
multi-phase CT.
:meth:`VisionLanguageModel.generate` answers greedily, scored by :mod:`gx_ray.metrics.cascade`. Images are RGB
``(3, H, W)`` arrays in [0, 1] (:func:`gx_ray.modalities.views.ct_images`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gx_ray.models.lora import LoraSettings, apply_lora

IGNORE = -100
TEXT_TOKENS = 256
"""The tokens of a text that retrieval's text side reads (:meth:`VisionLanguageModel.pooled`): most reports whole."""


VLM_LORA = LoraSettings(dropout=0.05)
"""LoRA on the language model's attention query and value projections, named as its family names them
(:data:`~gx_ray.models.lora.LORA_TARGETS`: ``q_proj``/``v_proj`` in LLaMA, Mistral, Qwen, Gemma, OPT; ``q``/``v`` in
T5)."""
VISION_MODULES = r".*(vision|visual).*"
"""Full module names of a vision tower (``vision_tower``, ``visual``): no adapters there unless ``lora_vision``."""
PACKABLE = {"llava": ("llama", "qwen2")}
"""Model types whose taught batch may be packed (``vlm.packing``), with the language models checked in them: a
decoder-only LLaVA, image tokens in the sequence under plain causal attention and 1D rotary positions, so position ids
that restart at 0 per sample give each sample its own block-diagonal causal mask (transformers' masking_utils)."""
MROPE = "its rotary positions are computed from the images' grids (mrope), not from position ids restarting at 0"
PACKING_REFUSED = {
    "paligemma": "its prefix-LM attention (token_type_ids: bidirectional over the image and the prompt) is not "
    "restarted per sample by position ids",
    "qwen2_vl": MROPE,
    "qwen2_5_vl": MROPE,
}
"""Why a model type may not be packed, where that is known; any other type not in :data:`PACKABLE` is refused too."""
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
"""Attention implementations that read packed samples from the position ids when no attention mask is given
(masking_utils' packed-sequence mask; flash attention's varlen kernel)."""
PLAIN_PROMPTS = {"blip-2": "Question: {} Answer:"}
"""Prompt formats of model types whose processor has no chat template and puts the image tokens in itself (BLIP-2's
Q-Former queries go before the text): BLIP-2's question-answering prompt."""
ONE_IMAGE = {"blip-2"}
"""Model types that read one image per prompt: a case's views must be one image (``views.phase_layout: channels``
and one slice or a MIP)."""


@dataclass(frozen=True)
class VLMConfig:
    """A trial's VLM (its ``vlm.*`` keys, read when ``model.family`` is ``vlm``); every field is a search dimension."""

    name: str = ""
    """A hub name (``Qwen/Qwen2-VL-2B-Instruct``) or a local folder holding the model and its processor."""
    lora: bool = True
    """LoRA adapters on ``lora_targets``; false: none (the model trains only where ``train_*`` opens it)."""
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_targets: tuple[str, ...] = ()
    """Module names (suffixes) that get adapters; a comma-separated string is read as the same list; empty or
    ``auto``: the language model's family's (:func:`~gx_ray.models.lora.family_targets`)."""
    lora_vision: bool = False
    """Adapters in the vision tower too (by default it has none)."""
    train_vision: bool = False
    train_language: bool = False
    gradient_checkpointing: bool = False
    max_new_tokens: int = 16
    """Tokens an answer may take (VQA, stage); reports take report generation's ``task_options.max_new_tokens``."""
    packing: bool = False
    """Padding-free training steps: the taught batch as one row, position ids restarting at 0 per sample and no
    attention mask (LLaVA only; other models are refused when the model loads). Generation and option scores stay
    padded."""
    plugin: str = ""
    """A model whose code is not in transformers: its class's ``module:Class`` reference or the name of an entry point
    of the group :data:`VLM_ENTRY_POINT_GROUP`, checked against the VLM protocol (:func:`vlm_protocol_problems`) as the
    config is read. Empty: transformers' classes (:class:`VisionLanguageModel`)."""
    stack_views: bool = False
    """A case's views (every phase's slices, ``views.*``) as the channels of ONE image, the vision tower's patch
    embedding widened to read them (:func:`widen_patch_embedding`): the paper's adaptation of LLaVA-1.5 and BLIP-2 to
    multi-phase CT. Off: each view is an image of its own."""

    def __post_init__(self) -> None:
        targets = self.lora_targets
        if isinstance(targets, str):  # "q_proj,v_proj": how a search space samples a set (Optuna takes strs)
            targets = targets.split(",")
        object.__setattr__(self, "lora_targets", tuple(t.strip() for t in targets if t.strip() not in ("", "auto")))
        if self.lora:
            self.lora_settings()  # a rank below 1 or no targets fails here, naming the setting
        elif not (self.train_vision or self.train_language or self.plugin):  # a plug-in trains parts of its own
            raise ValueError("vlm.lora is false and vlm.train_vision and vlm.train_language are off: nothing trains")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"vlm.max_new_tokens = {self.max_new_tokens!r} is not valid: a whole number >= 1")
        if not isinstance(self.packing, bool):
            raise ValueError(f"vlm.packing = {self.packing!r} is not valid: true or false")
        if self.plugin:
            vlm_class(self.plugin)  # a reference that does not load, or a class that lacks the protocol, fails here

    def lora_settings(self) -> LoraSettings | None:
        if not self.lora:
            return None
        return LoraSettings(
            rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout, target_modules=self.lora_targets
        )


class VisionLanguageModel(nn.Module):
    """A transformers image-text-to-text model and its processor, frozen but for LoRA adapters (``lora``) and,
    when asked, the vision tower (``train_vision``) or the language model (``train_language``)."""

    def __init__(
        self,
        name_or_path: str,
        lora: LoraSettings | None = VLM_LORA,
        lora_vision: bool = False,
        train_vision: bool = False,
        train_language: bool = False,
        dtype: torch.dtype | None = None,
        gradient_checkpointing: bool = False,
        packing: bool = False,
    ):
        super().__init__()
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from gx_ray.models.text import quiet_loading
        from gx_ray.models.tiny_vlms import local_weights

        quiet_loading()
        self.name_or_path = name_or_path
        weights = local_weights(name_or_path)
        self.processor = AutoProcessor.from_pretrained(weights)
        model = AutoModelForImageTextToText.from_pretrained(weights, dtype=dtype)
        model.requires_grad_(False)
        self.kind = model.config.model_type
        # an encoder-decoder language model (BLIP-2's Flan-T5): the prompt is encoded, the answer decoded
        self.seq2seq = bool(getattr(model.config.get_text_config(), "is_encoder_decoder", False))
        if packing:
            check_packing(model.config)
        self.packing = packing
        self.stacked_views = 0
        """Views stacked as one image's channels (:meth:`stack_views`); 0: each view its own image."""
        if gradient_checkpointing:
            # non-reentrant (PyTorch's recommended variant): it needs no block input that requires grad, which a
            # frozen base model does not give
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:
            model = apply_lora(model, lora, exclude=None if lora_vision else VISION_MODULES)
        for name, parameter in model.named_parameters():
            vision = "vision" in name or "visual" in name
            if (vision and train_vision) or (not vision and train_language and "lora_" not in name):
                parameter.requires_grad_(True)
        self.model = model

    def stack_views(self, views: int) -> None:
        """Reads each question's ``views`` images as one ``3 * views``-channel image from now on: the patch embedding
        widened (:func:`widen_patch_embedding`) and trained, as a weight no checkpoint has."""
        widened = widen_patch_embedding(self.model, views)
        widened.requires_grad_(True)
        self.stacked_views = views

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prompts(self, questions: Sequence[str], images_per_question: int) -> list[str]:
        """Each question with its images, in the model's chat template (a generation prompt follows), or as the
        question alone for a processor without a template (it places the image tokens itself)."""
        if self.kind in ONE_IMAGE and images_per_question != 1:
            raise ValueError(
                f"model type {self.kind!r} reads one image per question, not {images_per_question}: set "
                "views.phase_layout: channels with views.slices: 1 or views.mode: mip"
            )
        if not getattr(self.processor, "chat_template", None) and self.kind in PLAIN_PROMPTS:
            return [PLAIN_PROMPTS[self.kind].format(q) for q in questions]
        if not getattr(self.processor, "chat_template", None):  # PaliGemma: the image tokens, then the question
            token = getattr(self.processor, "image_token", None) or ""
            return [token * images_per_question + q for q in questions]
        return [
            self.processor.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [*[{"type": "image"}] * images_per_question, {"type": "text", "text": q}],
                    }
                ],
                add_generation_prompt=True,
            )
            for q in questions
        ]

    def _inputs(self, images: Sequence[Sequence[np.ndarray]], texts: Sequence[str]) -> dict[str, torch.Tensor]:
        pictures = [[to_pil(image) for image in case] for case in images]
        with warnings.catch_warnings():  # some processors pass a max_length the tokenizer then ignores, every call
            warnings.filterwarnings("ignore", message=".*max_length.* is ignored")
            # device: a processor with a torch backend resizes and normalises on the GPU (on the CPU, with a thread
            # per core, it took 0.5-0.8 s a batch of eight on a 64-core host: most of a 2 B model's step)
            # stacked views: the first view stands for the question's one image in the text (its image tokens)
            shown = [case[:1] for case in pictures] if self.stacked_views else pictures
            encoded = self.processor(
                images=shown, text=list(texts), return_tensors="pt", padding=True, device=self.device
            )
        if self.stacked_views:
            encoded["pixel_values"] = self._stacked_pixels(pictures)
        # labels are ours to make (the answer's tokens only); a processor's own would teach the prompt too
        return {k: v.to(self.device) for k, v in encoded.items() if isinstance(v, torch.Tensor) and k != "labels"}

    def _stacked_pixels(self, pictures: Sequence[Sequence[Any]]) -> torch.Tensor:
        """``(n, 3 * views, h, w)``: each view resized and normalised by the model's own image processor, a
        question's views concatenated along the channels."""
        if any(len(case) != self.stacked_views for case in pictures):
            raise ValueError(f"vlm.stack_views: the model reads {self.stacked_views} views a question, the batch "
                             f"gives {sorted({len(case) for case in pictures})}")  # fmt: skip
        flat = [picture for case in pictures for picture in case]
        pixels = self.processor.image_processor(images=flat, return_tensors="pt")["pixel_values"]
        return pixels.reshape(len(pictures), -1, *pixels.shape[-2:])

    def _prompt_inputs(
        self, images: Sequence[Sequence[np.ndarray]], questions: Sequence[str], padding_side: str
    ) -> dict[str, torch.Tensor]:
        """The questions with their images in the model's prompt, through the processor once, padded on
        ``padding_side`` (the tokenizer's own setting is left as it was)."""
        tokenizer = self.processor.tokenizer
        side, tokenizer.padding_side = tokenizer.padding_side, padding_side
        try:
            count = 1 if self.stacked_views else len(images[0]) if images else 0
            return self._inputs(images, self.prompts(questions, count))
        finally:
            tokenizer.padding_side = side

    def _taught(
        self, images: Sequence[Sequence[np.ndarray]], questions: Sequence[str], answers: Sequence[str]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The model's inputs for each question followed by its answer, labels only on the answer's tokens (and the
        end-of-text token). The prompts go through the processor once, exactly as :meth:`generate` puts them, so the
        model is taught to continue the very prompt it is asked with."""
        return self._with_answers(self._prompt_inputs(images, questions, "right"), answers, self.packing)

    def _with_answers(
        self, prompts: dict[str, torch.Tensor], answers: Sequence[str], packed: bool = False
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """Prompt inputs with each answer's tokens appended, padded on the tokenizer's own side, and the labels (the
        answers' tokens only). ``packed``: the samples in one unpadded row, as transformers'
        ``DataCollatorWithFlattening`` makes it: position ids restarting at 0, each sample's first label ignored
        (nothing predicted across a boundary), no attention mask: transformers builds a block-diagonal causal one."""
        tokenizer = self.processor.tokenizer
        eos = getattr(tokenizer, "eos_token", None) or getattr(tokenizer, "sep_token", None) or ""
        answer_ids = tokenizer([a + eos for a in answers], add_special_tokens=False)["input_ids"]
        ids, mask = prompts["input_ids"], prompts["attention_mask"]
        lengths = mask.sum(1).tolist()
        width = max(length + len(a) for length, a in zip(lengths, answer_ids, strict=True))
        per_token = [k for k, v in prompts.items() if v.shape[:2] == ids.shape and k not in ("input_ids", "labels")]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        inputs = {k: v for k, v in prompts.items() if k not in per_token and k != "input_ids"}
        # no KV cache in a forward that generates nothing: with gradient checkpointing transformers would turn it off
        # itself, warning every step; with a cache it does not look for packed samples in the position ids, and every
        # packed sample would attend to those before it in the row
        inputs["use_cache"] = False
        if self.seq2seq:  # the prompt is the encoder's; the labels are the decoder's, which the model shifts in itself
            answers_ = [torch.tensor(a, dtype=ids.dtype) for a in answer_ids]
            labels = torch.nn.utils.rnn.pad_sequence(answers_, batch_first=True, padding_value=IGNORE)
            return {**inputs, "input_ids": ids, **{k: prompts[k] for k in per_token}}, labels.to(ids.device)
        if packed:
            return self._packed(inputs, ids, lengths, answer_ids, per_token)
        rows = {key: [] for key in ("input_ids", "labels", *per_token)}
        for i, (length, answer) in enumerate(zip(lengths, answer_ids, strict=True)):
            answer = torch.tensor(answer, dtype=ids.dtype, device=ids.device)
            fill = width - length - len(answer)
            # padding on the tokenizer's own side: a model that pads on the left expects it there
            spans = (fill, 0) if tokenizer.padding_side == "left" else (0, fill)
            rows["input_ids"].append(_joined(ids[i, :length], answer, spans, pad))
            rows["labels"].append(_joined(ids.new_full((length,), IGNORE), answer, spans, IGNORE))
            for key in per_token:  # the attention mask is 1 and PaliGemma's token types mark the answer as the suffix
                value = 1 if key in ("attention_mask", "token_type_ids") else 0
                rows[key].append(_joined(prompts[key][i, :length], answer.new_full(answer.shape, value), spans, 0))
        stacked = {key: torch.stack(values) for key, values in rows.items()}
        labels = stacked.pop("labels")
        return {**inputs, **stacked}, labels

    def _packed(
        self,
        inputs: dict[str, torch.Tensor],
        ids: torch.Tensor,
        lengths: Sequence[int],
        answer_ids: Sequence[Sequence[int]],
        per_token: Sequence[str],
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """The packed row of :meth:`_with_answers` (``ids``: the right-padded prompts, ``lengths`` their lengths)."""
        from transformers import DataCollatorWithFlattening

        if extra := [key for key in per_token if key != "attention_mask"]:
            raise ValueError(f"vlm.packing: the processor gives per-token {extra}, which a packed row cannot carry")
        features = []
        for i, (length, answer) in enumerate(zip(lengths, answer_ids, strict=True)):
            prompt = ids[i, :length].tolist()
            features.append({"input_ids": prompt + list(answer), "labels": [IGNORE] * length + list(answer)})
        flat = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE)(features)
        labels = flat.pop("labels").to(ids.device)
        packed = {key: value.to(ids.device) for key, value in flat.items()}
        return {**inputs, **packed}, labels

    def loss(
        self, images: Sequence[Sequence[np.ndarray]], questions: Sequence[str], answers: Sequence[str]
    ) -> torch.Tensor:
        """Cross-entropy of the answers' tokens given the images and questions (prompt and images masked)."""
        inputs, labels = self._taught(images, questions, answers)
        return self.model(**inputs, labels=labels).loss

    @torch.no_grad()
    def option_scores(
        self, images: Sequence[Sequence[np.ndarray]], questions: Sequence[str], options: Sequence[Sequence[str]]
    ) -> torch.Tensor:
        """``(n, K)`` log-likelihoods of each question's ``K`` options as its answer (the sum over the option's tokens
        and the end of text): a closed question's class scores, so that stage classification through a VLM has an
        AUC (softmax over the options) and not only the accuracy of what it writes."""
        prompts = self._prompt_inputs(images, questions, "right")  # the images processed once for every option
        columns = []
        for k in range(len(options[0])):
            inputs, labels = self._with_answers(prompts, [choices[k] for choices in options])
            if self.seq2seq:  # the decoder's logits are the labels' own positions
                logits, targets = self.model(**inputs, labels=labels).logits.float(), labels
            else:
                logits, targets = self.model(**inputs).logits[:, :-1].float(), labels[:, 1:]
            columns.append(answer_log_likelihood(logits, targets))
        return torch.stack(columns, 1)

    @torch.no_grad()
    def generate(
        self, images: Sequence[Sequence[np.ndarray]], questions: Sequence[str], max_new_tokens: int = 32
    ) -> list[str]:
        """Greedy answers, without the prompt."""
        # padded on the left, prompts of unequal length all end where the answers start
        inputs = self._prompt_inputs(images, questions, "left")
        inputs.pop("token_type_ids", None)
        output = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        # a decoder-only model's output starts with the prompt; an encoder-decoder's is the answer alone
        new = output if self.seq2seq else output[:, inputs["input_ids"].shape[1] :]
        return self.processor.batch_decode(new, skip_special_tokens=True)

    def pooled(self, images: Sequence[Sequence[np.ndarray]], texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Retrieval's two sides, ``(n, d_image)`` and ``(n, d_text)``, each alone (no prompt, no template): each
        case's images as the language model receives them (``get_image_features``: LLaVA's projected patches,
        BLIP-2's language projection of its Q-Former queries) averaged over tokens and views, and each text's last
        hidden states in the language model (a T5's encoder), averaged over its first :data:`TEXT_TOKENS` tokens."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        pictures = [[to_pil(image) for image in case] for case in images]
        if self.stacked_views:
            pixels = self._stacked_pixels(pictures)
        else:
            flat = [picture for case in pictures for picture in case]
            pixels = self.processor.image_processor(images=flat, return_tensors="pt")["pixel_values"]
        features = base.get_image_features(pixel_values=pixels.to(self.device, base.dtype)).pooler_output
        image = torch.stack([f.float().mean(0) for f in features])  # a list (LLaVA) or (n, queries, d) (BLIP-2)
        image = image.reshape(len(pictures), -1, image.shape[-1]).mean(1)
        language = base.get_encoder() if self.seq2seq else base.get_decoder()
        return image, mean_text_state(language, self.processor.tokenizer, texts, self.device)

    def trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @classmethod
    def from_config(cls, config: VLMConfig, device: torch.device, views: int = 1) -> VisionLanguageModel:
        """The trial's model on ``device``: bf16 weights on a GPU, float32 on the CPU (CPUs lack fast bf16 matmuls).
        ``views``: the images a question comes with (the view recipe's), stacked under ``config.stack_views``."""
        if not config.name:
            raise ValueError("model.family vlm needs vlm.name: a hub name or a local folder")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = cls(
            config.name, config.lora_settings(), config.lora_vision, config.train_vision, config.train_language,
            dtype, config.gradient_checkpointing, config.packing,
        )  # fmt: skip
        if config.stack_views:
            model.stack_views(views)
        elif model.kind in ONE_IMAGE and views != 1:
            raise ValueError(
                f"model type {model.kind!r} reads one image per question and the views give {views}: set "
                "vlm.stack_views: true, or views.phase_layout: channels with views.slices: 1 or views.mode: mip"
            )
        return model.to(device)


VLM_ENTRY_POINT_GROUP = "gx_ray.models.vlm"
"""The entry-point group a distribution registers its vision-language models in (``vlm.plugin``: the entry point's
name)."""
VLM_METHODS = ("loss", "generate", "option_scores", "trainable")
"""What a VLM plug-in implements as :class:`VisionLanguageModel` does (the trial's module calls these)."""
RETRIEVAL_METHOD = "pooled"
"""What a VLM plug-in implements besides, as :class:`VisionLanguageModel` does, to be asked retrieval:
``pooled(images, texts)`` the pooled image and text states (:func:`retrieval_problem`)."""


class VLMPluginError(ValueError):
    """A ``vlm.plugin`` that gives no VLM: it names the reference and everything that is missing."""


def vlm_class(plugin: str = "") -> type:
    """The class a trial's VLM is built by: :class:`VisionLanguageModel` for ``""``; else the ``module:Class`` that
    ``plugin`` names, or the entry point of :data:`VLM_ENTRY_POINT_GROUP` it names, checked against the protocol
    (:func:`vlm_protocol_problems`). Raises :class:`VLMPluginError` naming the key and what is missing."""
    from gx_ray.plugins import entry_points_named, load_class

    if not plugin:
        return VisionLanguageModel
    where = f"vlm.plugin {plugin!r}"
    if ":" not in plugin:
        found = entry_points_named(VLM_ENTRY_POINT_GROUP, plugin)
        if len({ep.value for ep in found}) != 1:
            why = "registered more than once" if found else "neither 'module:Class' nor the name of an entry point"
            raise VLMPluginError(f"{where} is {why} of group {VLM_ENTRY_POINT_GROUP!r}")
        where, plugin = f"{where} (entry point {found[0].value})", found[0].value
    return load_class(plugin, where, vlm_protocol_problems, "gx_ray VLM", VLMPluginError)


def vlm_protocol_problems(cls: Any) -> list[str]:
    """What ``cls`` lacks to be a trial's VLM (empty: nothing): a ``torch.nn.Module`` (its state holds what trains)
    with a classmethod ``from_config(config, device, views)`` (the :class:`VLMConfig`, the device, a question's
    images), a ``tokenizer`` property (report generation cuts its targets with it), and :data:`VLM_METHODS` as
    :class:`VisionLanguageModel` has them: ``loss(images, questions, answers)`` a scalar, ``generate(images,
    questions, max_new_tokens)`` the answers' texts, ``option_scores(images, questions, options)`` an ``(n, K)``
    tensor of log-likelihoods, ``trainable()`` the parameters that train by name."""
    import inspect

    if not isinstance(cls, type):
        return [f"it is {type(cls).__name__} {cls!r}, not a class"]
    if not issubclass(cls, nn.Module):
        return [f"{cls.__qualname__} is not a subclass of torch.nn.Module"]
    problems = []
    if not isinstance(inspect.getattr_static(cls, "from_config", None), classmethod):
        problems.append("missing classmethod from_config(config, device, views)")
    else:
        try:
            inspect.signature(cls.from_config).bind(None, None, None)
        except TypeError:
            problems.append("from_config does not take (config, device, views)")
    if not hasattr(cls, "tokenizer"):
        problems.append("missing property tokenizer (report generation cuts its targets with it)")
    if missing := [m for m in VLM_METHODS if not callable(getattr(cls, m, None))]:
        problems.append(f"missing methods {', '.join(missing)}")
    return problems


def retrieval_problem(plugin: str = "") -> str | None:
    """Why the VLM that ``plugin`` names (:func:`vlm_class`) cannot be asked retrieval, or None: it lacks
    :data:`RETRIEVAL_METHOD`, which gives the retrieval head its two sides."""
    if callable(getattr(vlm_class(plugin), RETRIEVAL_METHOD, None)):
        return None
    return (
        f"vlm.plugin {plugin!r} has no method {RETRIEVAL_METHOD}(images, texts) -> (image states (n, d), text states "
        "(n, d')), which task retrieval's head reads: implement it, or ask another task"
    )


HUB_TIMEOUT_S = 10.0
"""How long the hub may take to say whether it has a model (a network that drops packets answers never)."""


def check_weights(names: Iterable[str], key: str = "vlm.name") -> None:
    """Refuse, before Ray starts, models that no trial could load: each name must be a local folder holding weights,
    be in this machine's Hugging Face cache with its weights, or be found on the hub (asked with a
    :data:`HUB_TIMEOUT_S` timeout; not at all under ``HF_HUB_OFFLINE``). Otherwise every trial of it would try the hub
    again and again (transformers retries for minutes) and fail. ``key``: the space's key that names them. Raises
    ``ValueError`` naming each model, why, and how to fetch it."""
    from huggingface_hub import constants

    missing = {name: why for name in sorted(set(names)) if (why := _why_not_loadable(name))}
    if missing:
        named = "; ".join(f"{name}: {why}" for name, why in missing.items())
        raise ValueError(
            f"{named}. Fetch the weights on a machine with network (`hf download NAME`, or `huggingface-cli download "
            f"NAME`) into the Hugging Face cache this machine reads ({constants.HF_HUB_CACHE}: copy it here, or set "
            f"HF_HOME to a copy), or point {key} at a folder holding the model and its processor"
        )


def _why_not_loadable(name: str) -> str | None:
    """None where ``name``'s weights are at hand (a folder, the cache) or on the hub; else why not."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from gx_ray.models.tiny_vlms import PREFIX, local_weights

    if name.startswith(PREFIX):  # built here, before any trial asks for it
        try:
            local_weights(name)
            return None
        except ValueError as err:
            return str(err).removeprefix(f"{name}: ")
    if Path(name).is_dir():  # what transformers' from_pretrained loads first
        lacking = _missing_weights(Path(name))
        return f"the folder has {lacking}" if lacking else None
    try:
        lacking = _missing_weights(Path(snapshot_download(name, local_files_only=True)))
        if lacking is None:
            return None
        cache = f"its copy in the Hugging Face cache has {lacking}"
    except HFValidationError:
        return "no such folder, and not a hub name"
    except LocalEntryNotFoundError:
        cache = "it is not in the Hugging Face cache"
    if constants.is_offline_mode():
        return f"{cache}, and HF_HUB_OFFLINE is set: the hub was not asked"
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
        return None
    except GatedRepoError:
        return f"{cache}, and it is gated on the hub: accept its terms there and log in here (`hf auth login`)"
    except RepositoryNotFoundError:
        return f"{cache}, and the hub has no such model (a private one needs `hf auth login`)"
    except Exception as error:  # noqa: BLE001 - no network, no DNS, a timeout: the hub did not answer
        return f"{cache}, and the hub did not answer ({type(error).__name__})"


def _missing_weights(folder: Path) -> str | None:
    """What ``folder`` lacks of a model's weights, None when they are whole: a safetensors or PyTorch weights file,
    or an index (sharded weights) with every shard it lists."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
            lost = sorted(shard for shard in shards if not (folder / shard).is_file())
            return f"{index_name} but not its shards {', '.join(lost)}" if lost else None
    if any(path.is_file() for path in folder.glob("*.safetensors")) or (folder / "pytorch_model.bin").is_file():
        return None
    return "no weights (*.safetensors, pytorch_model.bin)"


def check_packing(config: Any) -> None:
    """Refuses ``vlm.packing`` for a model whose packed batch would not be each sample alone: any model type but
    those of :data:`PACKABLE` (with their language models), or an attention implementation that does not read packed
    samples from the position ids. Raises ``ValueError`` naming the key and the model type."""
    kind = getattr(config, "model_type", "?")
    text = getattr(config, "text_config", None)
    text_kind = getattr(text, "model_type", "?")
    supported = ", ".join(f"{k} (language model {' or '.join(v)})" for k, v in PACKABLE.items())
    if kind not in PACKABLE or text_kind not in PACKABLE[kind]:
        why = PACKING_REFUSED.get(kind, "packing is not verified for it")
        name = kind if kind not in PACKABLE else f"{kind} with language model {text_kind}"
        raise ValueError(
            f"vlm.packing is not supported for model type {name!r}: {why}. Packing is built for {supported}; "
            "set vlm.packing: false"
        )
    attention = getattr(text, "_attn_implementation", None)
    if attention not in PACKED_ATTENTION:
        raise ValueError(
            f"vlm.packing is not supported for model type {kind!r} with attention {attention!r}: "
            f"packed samples are read from the position ids by {', '.join(PACKED_ATTENTION)} only"
        )


def widen_patch_embedding(model: nn.Module, views: int) -> nn.Conv2d:
    """``model``'s vision tower made to read ``views`` RGB images stacked as one ``3 * views``-channel image: its
    patch embedding (the vision tower's 2D convolution over RGB) replaced by one whose kernel is the pretrained kernel
    divided by ``views`` on each image's three channels, so that ``views`` copies of one image embed exactly as that
    image did. Returns the new convolution; raises ``ValueError`` for a vision tower without such a convolution
    (Qwen2-VL's 3D patches)."""
    import re

    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Conv2d) and module.in_channels == 3 and re.fullmatch(VISION_MODULES, name)
    ]
    if not found:
        raise ValueError("vlm.stack_views: the model's vision tower has no 2D patch embedding over RGB to widen")
    name, old = found[0]
    wide = nn.Conv2d(
        3 * views, old.out_channels, old.kernel_size, old.stride, old.padding, bias=old.bias is not None,
        device=old.weight.device, dtype=old.weight.dtype,
    )  # fmt: skip
    with torch.no_grad():
        wide.weight.copy_(old.weight.repeat(1, views, 1, 1) / views)
        if old.bias is not None:
            wide.bias.copy_(old.bias)
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, wide)
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is not None and hasattr(vision, "num_channels"):
        vision.num_channels = 3 * views
    return wide


def _joined(prompt: torch.Tensor, answer: torch.Tensor, spans: tuple[int, int], padding: int) -> torch.Tensor:
    """One row of a taught batch: padding, the prompt's tokens, the answer's, padding (``spans``: before, after)."""
    before, after = spans
    return torch.cat(
        [prompt.new_full((before,), padding), prompt, answer.to(prompt.dtype), prompt.new_full((after,), padding)]
    )


def to_pil(image: np.ndarray) -> Any:
    """A view (``(C, H, W)`` or ``(H, W, C)``, floats in [0, 1] or bytes) as the PIL image processors take."""
    from PIL import Image

    array = np.asarray(image)
    if array.ndim == 3 and array.shape[0] in (1, 3):  # (C, H, W) → (H, W, C)
        array = np.moveaxis(array, 0, -1)
    if array.dtype != np.uint8:
        array = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
    return Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array)


# --- what the plug-ins built on a causal language model share (gx_ray.models.flamingo, gx_ray.models.prefix) ---------


def read_settings(cls: Any, path: Path) -> Any:
    """A plug-in's settings dataclass ``cls`` from the JSON file ``path``; unknown keys refused, naming the file."""
    values = json.loads(path.read_text(encoding="utf-8"))
    unknown = sorted(set(values) - set(cls.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}")
    return cls(**values)


def answer_rows(
    tokenizer: Any, prompts: Sequence[str], answers: Sequence[str], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels of each prompt followed by its answer and the end of text,
    the answers' tokens alone taught; an empty answer gives the prompt alone (generation's start)."""
    rows, labels = [], []
    for prompt_text, answer in zip(prompts, answers, strict=True):
        prompt = tokenizer(prompt_text)["input_ids"]
        said = f" {answer}{tokenizer.eos_token}" if answer else ""
        taught = tokenizer(said, add_special_tokens=False)["input_ids"]
        rows.append(torch.tensor(prompt + taught))
        labels.append(torch.tensor([IGNORE] * len(prompt) + taught))
    pad = nn.utils.rnn.pad_sequence
    ids = pad(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
    mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True)
    return ids.to(device), mask.to(device), pad(labels, batch_first=True, padding_value=IGNORE).to(device)


def answer_log_likelihood(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the summed log-probability of its taught tokens (``targets`` other than ``IGNORE``) under ``logits``
    at the same positions: an option's score."""
    log_probs = logits.float().log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (log_probs * (targets != IGNORE)).sum(1)


def mean_text_state(language: nn.Module, tokenizer: Any, texts: Sequence[str], device: torch.device) -> torch.Tensor:
    """Each text's last hidden states in ``language``, averaged over its first :data:`TEXT_TOKENS` tokens: retrieval's
    text side."""
    encoded = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                        max_length=min(TEXT_TOKENS, tokenizer.model_max_length)).to(device)  # fmt: skip
    mask = encoded["attention_mask"]
    hidden = language(input_ids=encoded["input_ids"], attention_mask=mask, output_hidden_states=True,
                      use_cache=False).hidden_states[-1].float()  # fmt: skip
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)


def greedy_answer(
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    mask: torch.Tensor,
    tokenizer: Any,
    max_new_tokens: int,
) -> str:
    """One prompt's greedy answer, decoded: ``logits_of(ids, mask)`` run on the whole sequence again for each token
    (no key-value cache) until the end of text."""
    start = ids.shape[1]
    for _ in range(max_new_tokens):
        token = logits_of(ids, mask)[:, -1].argmax(-1, keepdim=True)
        if int(token) == tokenizer.eos_token_id:
            break
        ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return tokenizer.decode(ids[0, start:], skip_special_tokens=True)
