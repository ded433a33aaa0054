"""Images in prompts: loading them, turning chat messages with images into token ids and pixel
values, and the multimodal rotary positions a Qwen2.5-VL-style model needs.

A prompt with images is its token ids, in which the model's image placeholder (Qwen-VL's
``<|image_pad|>``, LLaVA's ``<image>``) is already repeated once per image token, plus
:class:`ImageInputs`: the image processor's ``pixel_values`` (Qwen-VL: one row per vision patch;
fixed-resolution families such as LLaVA: one ``[3, H, W]`` image each) and, for Qwen-VL,
``image_grid_thw`` (one row per image: temporal, height and width patch counts). The ids and the pixels travel together
from the dataset (:attr:`rlcore.interfaces.Sample.images`) through generation, the training
batch (:attr:`rlcore.interfaces.SequenceBatch.images`) and packing
(:attr:`rlcore.data.packing.MicroBatch.images`, per sequence), so the trainer scores exactly what the generator saw.

Several sequences of a batch often carry the same images (a GRPO group's samples share their
prompt's: one :class:`ImageInputs` object). :func:`encode_each_once` runs the vision tower on the
distinct ones of a forward pass and copies its outputs to every sequence's rows;
:func:`encoding_shared_images_once` sets it up for a model and its sequences' images.

Prompts are built the way the model's processor builds them (chat template rendered with an
image entry per image, each placeholder expanded to the image's token count: Qwen-VL's
``grid_t * grid_h * grid_w / merge_size**2``, by rlcore from the image processor alone, since the
Qwen-VL processor needs torchvision; other families' by their own saved processor), from the
tokenizer and the image processor saved in the model directory. The image processor is loaded
with its PIL backend: the torchvision one is not installed with rlcore.

This module imports torch and PIL lazily.
"""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from rlcore.config.images import MAX_IMAGE_PIXELS
from rlcore.interfaces.data import ImageInputs  # defined beside the data it travels with; imported from here too

if TYPE_CHECKING:
    import torch
    from PIL import Image as PILImage

IMAGE_TOKEN = "<|image_pad|>"


class ImageError(ValueError):
    """An image of a dataset that cannot be used; the message names the file and row."""


# ---- loading ---------------------------------------------------------------------------------
def load_image(ref: str, base_dir: str | Path, source: str, max_pixels: int = MAX_IMAGE_PIXELS) -> PILImage.Image:
    """An RGB image from ``ref``: a path relative to ``base_dir`` (the data file's directory) or
    ``data:image/...;base64,...``. ``source`` (``file:row``) is named in every error."""
    from PIL import Image, UnidentifiedImageError

    if ref.startswith("data:"):
        try:
            raw = base64.b64decode(ref.split(",", 1)[1], validate=True)
        except (IndexError, ValueError) as exc:
            raise ImageError(f"{source}: the image is not valid base64 data ({exc})") from None
        what, opener = "the base64 image", lambda: io.BytesIO(raw)
    else:
        path = Path(base_dir) / ref
        if not path.is_file():
            raise ImageError(f"{source}: image file {str(path)!r} does not exist")
        what, opener = f"image file {str(path)!r}", lambda: open(path, "rb")  # noqa: SIM115 - closed below
    try:
        with opener() as handle, Image.open(handle) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"{source}: {what} is {width}x{height}, more than the {max_pixels} pixels allowed")
            image.load()  # decodes now: a truncated file fails here, not in the middle of a step
            return image.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{source}: {what} is not an image PIL can read") from None
    except (OSError, SyntaxError) as exc:  # PIL reports truncated or corrupt data as OSError
        raise ImageError(f"{source}: {what} is truncated or corrupt ({exc})") from None


# ---- prompts ---------------------------------------------------------------------------------
def load_image_processor(model_dir: str | Path) -> Any:
    """The image processor saved in ``model_dir`` (``preprocessor_config.json``, or the image
    processor entry of ``processor_config.json``), PIL backend."""
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")


def load_prompt_processor(model_dir: str | Path, tokenizer: Any) -> ImagePromptProcessor:
    """The :class:`ImagePromptProcessor` of the model saved in ``model_dir``: Qwen-VL's (a patch grid
    image processor) from its image processor alone, any other family's through its saved processor."""
    image_processor = load_image_processor(model_dir)
    if hasattr(image_processor, "merge_size"):
        return ImagePromptProcessor(tokenizer, image_processor)
    from transformers import AutoProcessor

    return ImagePromptProcessor(tokenizer, image_processor, processor=AutoProcessor.from_pretrained(str(model_dir)))


class ImagePromptProcessor:
    """Chat messages with images -> (prompt ids with expanded placeholders, :class:`ImageInputs`).

    Messages follow the transformers convention: a message's ``content`` is a string or a list of
    ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` entries, one per image, in order.

    Without ``processor``, the Qwen-VL layout (``<|image_pad|>`` repeated per merged patch); with it
    (a transformers processor that has an ``image_token``, such as LLaVA's), the processor expands
    the rendered prompt's placeholders and processes the images."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, processor: Any = None):
        self.tokenizer, self.image_processor, self.processor = tokenizer, image_processor, processor
        self.image_token = IMAGE_TOKEN if processor is None else str(processor.image_token)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            what = "a Qwen-VL-style model's tokenizer" if processor is None else f"the tokenizer of {type(processor).__name__}"
            raise ValueError(f"the tokenizer has no {self.image_token} token: it is not {what}")
        self.merge_size = int(getattr(image_processor, "merge_size", 2))

    def __call__(self, messages: list[dict], images: Sequence[PILImage.Image]) -> tuple[list[int], ImageInputs | None]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if text.count(self.image_token) != len(images):
            raise ValueError(f"the messages hold {text.count(self.image_token)} image entries but {len(images)} images were given")
        if not images:
            return list(self.tokenizer.encode(text, add_special_tokens=False)), None
        if self.processor is not None:
            out = self.processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
            return out["input_ids"][0].tolist(), ImageInputs(out["pixel_values"].float())
        out = self.image_processor(images=list(images), return_tensors="pt")
        grid_I3 = out["image_grid_thw"].long()
        pieces = text.split(IMAGE_TOKEN)
        ids: list[int] = list(self.tokenizer.encode(pieces[0], add_special_tokens=False))
        for grid_3, piece in zip(grid_I3.tolist(), pieces[1:]):
            ids += [self.image_token_id] * (grid_3[0] * grid_3[1] * grid_3[2] // self.merge_size**2)
            ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids, ImageInputs(out["pixel_values"].float(), grid_I3)


# ---- models ----------------------------------------------------------------------------------
def is_vision_language(hf_config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(hf_config, "vision_config", None) is not None


def uses_multimodal_rope(model: Any) -> bool:
    """Whether the model places image tokens by multimodal rotary positions (Qwen-VL's ``get_rope_index``);
    the others (LLaVA) take plain positions."""
    return hasattr(getattr(model, "model", model), "get_rope_index")


def vision_modules(model: Any) -> list[Any]:
    """The vision tower and the layers that project its features into the decoder (Qwen-VL's
    ``visual``; LLaVA's ``vision_tower`` and ``multi_modal_projector``)."""
    base = getattr(model, "model", model)
    found = [getattr(base, name) for name in ("visual", "vision_tower", "multi_modal_projector") if hasattr(base, name)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no vision tower this module knows (visual, vision_tower)")
    return found


def mrope_positions(model: Any, ids_L: torch.Tensor, images: ImageInputs | None, image_token: int) -> torch.Tensor:
    """Multimodal rotary positions [3, L] of one sequence (temporal, height, width), from the
    model's own ``get_rope_index``: text tokens count up on all three, an image's tokens take its
    grid coordinates. Without images: ``arange(L)`` three times."""
    import torch

    if images is None or images.num_images == 0:
        return torch.arange(ids_L.numel(), device=ids_L.device).expand(3, -1)
    base = getattr(model, "model", model)
    positions_3BL, _ = base.get_rope_index(ids_L[None], mm_token_type_ids=(ids_L == image_token).int()[None],
                                           image_grid_thw=images.image_grid_thw_I3.to(ids_L.device))
    return positions_3BL[:, 0]


@attrs.frozen
class SharedImages:
    """Which images of a forward pass are copies of others: the same :class:`ImageInputs` object in
    several sequences (identity, so finding them costs nothing and never mistakes two images for one).

    ``unique_rows``: the rows of the concatenated ``pixel_values`` (Qwen-VL: patches; LLaVA: images)
    of each distinct object's first occurrence; ``unique_grid_I3``: their grids (Qwen-VL);
    ``gather``: for each leading size the vision tower's outputs can have when run on the distinct
    images only (Qwen-VL: patches and merged tokens; LLaVA: images), the rows that rebuild the outputs
    of all of them, in the order the model expects."""

    unique_rows: torch.Tensor
    unique_grid_I3: torch.Tensor | None
    gather: dict[int, torch.Tensor]
    num_rows: int  # of the concatenated pixel_values: what the tower is called with

    @staticmethod
    def find(per_seq: Sequence[ImageInputs | None], merge_size: int = 1) -> SharedImages | None:
        """None when every object with images occurs once (nothing to share)."""
        import torch

        present = [p for p in per_seq if p is not None and p.num_images]
        first: dict[int, int] = {}
        for position, images in enumerate(present):
            first.setdefault(id(images), position)
        if len(first) == len(present):
            return None
        distinct = [present[p] for p in first.values()]
        grids = present[0].image_grid_thw_I3 is not None

        def rows(images: ImageInputs, divide: int) -> int:
            if not grids:
                return images.num_images
            return int(images.image_grid_thw_I3.prod(-1).sum()) // divide

        def gather(divide: int) -> tuple[int, torch.Tensor]:
            start, offsets = 0, {}
            for images in distinct:
                offsets[id(images)] = start
                start += rows(images, divide)
            index = [offsets[id(images)] + r for images in present for r in range(rows(images, divide))]
            return start, torch.tensor(index, dtype=torch.long)

        starts, row = [], 0
        for images in present:
            starts.append(row)
            row += rows(images, 1)
        unique_rows = torch.tensor([starts[p] + r for p in first.values() for r in range(rows(present[p], 1))],
                                   dtype=torch.long)
        levels = dict([gather(1)] + ([gather(merge_size * merge_size)] if grids and merge_size > 1 else []))
        grid = torch.cat([images.image_grid_thw_I3 for images in distinct]) if grids else None
        return SharedImages(unique_rows, grid, levels, row)

    def to(self, device: Any) -> SharedImages:
        return SharedImages(self.unique_rows.to(device), None if self.unique_grid_I3 is None else self.unique_grid_I3.to(device),
                            {size: index.to(device) for size, index in self.gather.items()}, self.num_rows)

    def expand(self, output: Any, where: str = "output") -> Any:
        """The vision tower's ``output`` on the distinct images -> the output on all of them: every
        tensor's rows gathered (a tensor, tuples and lists of them, transformers' ``ModelOutput``).
        The gather's backward sums the copies' gradients: the gradient of encoding each copy."""
        import torch

        if isinstance(output, torch.Tensor):
            if output.dim() == 0 or output.shape[0] not in self.gather:
                raise ValueError(f"vision tower {where}: leading size {tuple(output.shape)[:1]} is none of the distinct "
                                 f"images' row counts {sorted(self.gather)}; encode_each_once does not know this tower")
            return output.index_select(0, self.gather[output.shape[0]])
        if isinstance(output, (tuple, list)) and not hasattr(output, "keys"):
            return type(output)(self.expand(item, f"{where}[{i}]") for i, item in enumerate(output))
        if hasattr(output, "keys"):  # a ModelOutput (an OrderedDict of its non-None fields)
            return type(output)(**{key: self.expand(value, f"{where}.{key}") for key, value in output.items()})
        if output is None:
            return None
        raise ValueError(f"vision tower {where}: a {type(output).__name__}, which encode_each_once cannot expand")


@contextlib.contextmanager
def encode_each_once(tower: torch.nn.Module | None, shared: SharedImages | None) -> Iterator[None]:
    """While inside, ``tower`` (the model's vision encoder) encodes each distinct image of ``shared`` once:
    its pixels are cut to the distinct rows on the way in, its outputs gathered back to all rows on the
    way out (forward hooks; the model around it sees every image, as without sharing)."""
    if shared is None:
        yield
        return

    def cut(module, args, kwargs):
        pixels, *rest = args
        if pixels.shape[0] != shared.num_rows:
            raise ValueError(f"encode_each_once: the vision tower got {pixels.shape[0]} rows of pixels, the sequences' "
                             f"images have {shared.num_rows}")
        if "grid_thw" in kwargs and shared.unique_grid_I3 is not None:
            kwargs = {**kwargs, "grid_thw": shared.unique_grid_I3}
        return (pixels.index_select(0, shared.unique_rows), *rest), kwargs

    def copy_back(module, args, kwargs, output):
        return shared.expand(output)

    handles = [tower.register_forward_pre_hook(cut, with_kwargs=True),
               tower.register_forward_hook(copy_back, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def encoding_shared_images_once(model: Any, per_seq: Sequence[ImageInputs | None] | None,
                                device: Any) -> contextlib.AbstractContextManager[None]:
    """:func:`encode_each_once` for a vision-language ``model`` called with ``per_seq`` (each sequence's
    images, in order; None: a call without images): its vision tower encodes each shared images object once.
    Does nothing when no object is shared."""
    shared = None if per_seq is None else SharedImages.find(
        per_seq, getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", 1))
    if shared is None:
        return contextlib.nullcontext()
    return encode_each_once(vision_modules(model)[0], shared.to(device))
