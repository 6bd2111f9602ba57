"""A prompt with images, as the engine runs it.

The chat template puts one image-pad token where each image goes (between vision-start and vision-end); here
that one token becomes the image's token count (``expand``), as transformers' processor does. Then, per
request (``Vision.begin`` ... ``Vision.end``):

  - key ids: the prompt's ids with every image token replaced by an id above the vocabulary made from the
    image's content hash (SHA-256 of its pixel values and grid). The runner and the prefix cache
    (engine.core.prefix) see these, so a prefix is reused only where the same images sit at the same places:
    a follow-up turn on the same image reuses its K/V and states and does not run the tower again;
  - embeddings: the model's prompt-embedding hook (``Model.embed_prompt``) embeds a prefill chunk's tokens
    (key ids mapped back to the image-pad id) and puts each image's embeddings over its tokens; the tower
    runs for an image the first time a chunk reaches it (none if the prefix cache covers it), and its output
    is kept by content hash for later requests (``cache_images`` of them, least recently used out);
  - rotary: engine.vision.mrope rewrites the model's cos / sin tables from the first image on.

``encoded`` lists (image digest, hash of the tower's output) of the images this request encoded: the rank's
lockstep compares them with the peer's, so two ranks whose towers disagree stop rather than answer.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import torch
import torch.nn.functional as F

from engine.vision import mrope
from engine.vision.config import ImageRules, VisionConfig
from engine.vision.preprocess import Pixels
from engine.vision.tower import Tower

KEY_BITS = 60  # a key id is vocab_size + 60 bits of the image's digest: below 2^63 (the prefix cache's int64)


class ImagePromptError(ValueError):
    """Images and image tokens that do not match, with the reason."""


def digest(p: Pixels) -> str:
    h = hashlib.sha256(repr(p.grid).encode())
    h.update(memoryview(p.values).cast("B"))
    return h.hexdigest()


def expand(ids: list[int], images: list[Pixels], cfg: VisionConfig) -> list[int]:
    """One image-pad token per image -> that image's token count of them (in order)."""
    pads = [i for i, t in enumerate(ids) if t == cfg.image_token_id]
    if len(pads) != len(images):
        raise ImagePromptError(f"the prompt holds {len(pads)} image token(s) for {len(images)} image(s)")
    out: list[int] = []
    last = 0
    for i, p in zip(pads, images):
        out += ids[last:i] + [cfg.image_token_id] * p.tokens(cfg.spatial_merge_size)
        last = i + 1
    return out + ids[last:]


@dataclasses.dataclass
class Span:
    start: int
    pixels: Pixels
    digest: str
    tokens: int
    grid: tuple[int, int]  # merged (rows, columns)


class Vision:
    """The rank's vision side: the tower, the encoder-output cache, and the model's hooks for one request."""

    def __init__(self, model, tower: Tower, cfg: VisionConfig, rules: ImageRules, cache_images: int = 8):
        self.model, self.tower, self.cfg, self.rules = model, tower, cfg, rules
        self.cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.cache_images = cache_images
        self.tables_from: int | None = None  # the first cache row that holds multimodal rotary (None: all plain)
        self.spans: list[Span] = []
        self.encoded: list[tuple[str, str]] = []
        self.encoder_runs = 0

    # ---- a request ---------------------------------------------------------------------------------
    def begin(self, ids: list[int], images: list[Pixels]) -> list[int]:
        """Set the model up for this prompt (ids with its images' tokens expanded) -> the key ids to run."""
        cfg, model = self.cfg, self.model
        self.spans, self.encoded = self._spans(ids, images), []
        if not self.spans:
            if self.tables_from is not None:
                mrope.restore(model, self.tables_from, cfg)
                self.tables_from = None
            model.embed_prompt = None
            return list(ids)
        pos3, delta = mrope.positions(ids, [(s.start, s.tokens, *s.grid) for s in self.spans])
        first = self.spans[0].start
        if self.tables_from is not None and self.tables_from < first:
            mrope.restore(model, self.tables_from, cfg)
        mrope.write(model, pos3, delta, first, cfg)
        self.tables_from = first
        model.embed_prompt = self.embed
        return self._keys(ids, self.spans)

    def _keys(self, ids: list[int], spans: list[Span]) -> list[int]:
        keys = list(ids)
        for s in spans:
            keys[s.start:s.start + s.tokens] = [self.model.cfg.vocab_size + int(s.digest[:KEY_BITS // 4], 16)] * s.tokens
        return keys

    def slot_prompt(self, ids: list[int], images: list[Pixels]):
        """A prompt with images for one sequence slot of the batch loop (engine/service/rank_batch_images.py), the
        model's tables left as they are -> (key ids, spans, the prompt's own cos / sin rows [T, rot] in the
        model's dtype, delta: what every position after the prompt adds to its rotary position)."""
        spans = self._spans(ids, images)
        pos3, delta = mrope.positions(ids, [(s.start, s.tokens, *s.grid) for s in spans])
        cos, sin = mrope.table_rows(self.model, pos3, self.cfg.mrope_section)  # text rows are the plain rows
        return self._keys(ids, spans), spans, cos, sin, delta

    def end(self) -> None:
        """After the request: the hook off (the tables stay until a request needs other rows)."""
        self.model.embed_prompt = None
        self.spans = []
        self._trim(set())

    def _spans(self, ids: list[int], images: list[Pixels]) -> list[Span]:
        cfg = self.cfg
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == cfg.image_token_id:
                j = i
                while j < len(ids) and ids[j] == cfg.image_token_id:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if len(runs) != len(images):
            raise ImagePromptError(f"the prompt holds {len(runs)} run(s) of image tokens for {len(images)} image(s)")
        spans = []
        m = cfg.spatial_merge_size
        for (start, n), p in zip(runs, images):
            if n != p.tokens(m):
                raise ImagePromptError(f"an image of grid {p.grid} takes {p.tokens(m)} tokens; the prompt gives it {n}")
            spans.append(Span(start, p, digest(p), n, (p.grid[1] // m, p.grid[2] // m)))
        return spans

    # ---- the model's hook ----------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, pos0: int) -> torch.Tensor:
        """tokens [1, T] (key ids) at positions pos0.. -> embeddings [1, T, D] with the images' rows in place."""
        model = self.model
        t = tokens.shape[1]
        ids = torch.where(tokens >= model.cfg.vocab_size, self.cfg.image_token_id, tokens)
        x = F.embedding(ids, model.embed)
        for s in self.spans:
            a, b = max(pos0, s.start), min(pos0 + t, s.start + s.tokens)
            if a < b:
                x[0, a - pos0:b - pos0] = self.embeddings(s)[a - s.start:b - s.start].to(x.dtype)
        return x

    def embeddings(self, s: Span) -> torch.Tensor:
        """The tower's output for a span's image [tokens, D] (from the cache, or encoded now)."""
        hit = self.cache.get(s.digest)
        if hit is not None:
            self.cache.move_to_end(s.digest)
            return hit
        out = self.tower.forward(torch.from_numpy(s.pixels.values), s.pixels.grid)
        self.encoder_runs += 1
        raw = out.contiguous().view(torch.uint8).cpu().numpy()  # the output's own bits, any dtype
        self.encoded.append((s.digest, hashlib.sha256(raw.tobytes()).hexdigest()))
        self.cache[s.digest] = out
        self._trim({sp.digest for sp in self.spans})  # this request's images stay until its prefill is done
        return out

    def _trim(self, keep: set[str]) -> None:
        for old in [k for k in self.cache if k not in keep][:max(0, len(self.cache) - self.cache_images)]:
            del self.cache[old]

    def forget(self) -> None:
        """Drop the encoder-output cache (e.g. --no-vision at run time, or memory pressure)."""
        self.cache.clear()
