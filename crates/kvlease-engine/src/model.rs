//! The synthetic model: makes the KV cache real without a GPU.
//!
//! Every token's KV bytes are a deterministic function of the token prefix (so P and a local
//! run write the same bytes), and every generated token is a function of the KV bytes actually
//! held in the block pool: the first from a digest of the whole prompt's KV as read back from the
//! pool, each next one from the previous digest and the KV just written. A wrong, stale or torn
//! transfer therefore changes the output (SPEC D7). Compute time is emulated per prefill token and
//! per decode step, so queueing and overload happen as on a GPU.
//!
//! Tokens: 0..256 are bytes, 256..256+WORDS are words (what the model generates; in text, a word
//! after a space is its token, so an answer tokenizes back to its tokens; everything else is
//! UTF-8 bytes), `EOS` ends a completion with `finish_reason = "stop"`.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Words the model speaks, one token each.
const WORDS: [&str; 64] = [
    "the",
    "lease",
    "block",
    "cache",
    "decode",
    "prefill",
    "heartbeat",
    "engine",
    "token",
    "model",
    "river",
    "stone",
    "light",
    "quiet",
    "green",
    "north",
    "window",
    "signal",
    "garden",
    "paper",
    "silver",
    "morning",
    "harbor",
    "orbit",
    "velvet",
    "copper",
    "meadow",
    "lantern",
    "thunder",
    "violet",
    "echo",
    "summit",
    "canyon",
    "ember",
    "glacier",
    "willow",
    "falcon",
    "marble",
    "prism",
    "tide",
    "cedar",
    "comet",
    "delta",
    "fable",
    "grove",
    "haven",
    "island",
    "jade",
    "kernel",
    "lumen",
    "mosaic",
    "nectar",
    "opal",
    "pebble",
    "quartz",
    "ripple",
    "sonnet",
    "tundra",
    "umber",
    "vortex",
    "whisper",
    "xenon",
    "yarrow",
    "zephyr",
];
pub const FIRST_WORD: u32 = 256;
pub const EOS: u32 = FIRST_WORD + WORDS.len() as u32;
/// Token ids a prompt may use: bytes, words, EOS.
pub const VOCAB_SIZE: u32 = EOS + 1;

/// The model's shape and speed (`kvlease serve` flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// The name `/v1/models` lists and requests must name.
    pub name: String,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    pub max_model_len: u32,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: "kvlease-synthetic".into(),
            num_layers: 2,
            num_kv_heads: 4,
            head_dim: 16,
            dtype_bytes: 2,
            block_size: 16,
            max_model_len: 4096,
            prefill_ms_per_token: 0.0,
            decode_ms_per_token: 0.0,
        }
    }
}

/// A configuration an engine cannot run with; every message names the flag to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("--tp-size {tp_size} must divide --num-kv-heads {num_kv_heads}")]
    TpSize { tp_size: u32, num_kv_heads: u32 },
    #[error("{0} must be a finite number ≥ 0")]
    NotFinite(&'static str),
    #[error(
        "a KV block (heads per rank × layers × 2 × --block-size × --head-dim × --dtype-bytes) would exceed 64 MiB: reduce the geometry"
    )]
    BlockTooLarge,
    #[error("--num-gpu-blocks {blocks}: {why}")]
    Arena { blocks: u32, why: kvlease_transport::ArenaError },
    #[error("this kvlease was built without NIXL support: build it with `--features nixl`")]
    NoNixl,
    /// SPEC S6: the engine id is its certificate's.
    #[error(
        "--engine-id {engine_id:?} is not the engine --kv-transfer-tls-cert names ({cert:?}): give --engine-id {cert:?}, or leave it out"
    )]
    EngineIdNotCert { engine_id: String, cert: String },
    /// Another flag, as its fixed message says.
    #[error("{0}")]
    Flag(&'static str),
}

/// The engine's checks of its other flags are fixed messages.
impl From<&'static str> for ConfigError {
    fn from(message: &'static str) -> Self {
        ConfigError::Flag(message)
    }
}

impl ModelConfig {
    /// Bytes of one head's K (or V) for one token.
    pub fn head_bytes(&self) -> usize {
        (self.head_dim * self.dtype_bytes) as usize
    }

    /// Bytes of one KV head's slice of a block: all layers, K and V, all token slots.
    pub fn head_block_bytes(&self) -> usize {
        self.num_layers as usize * 2 * self.block_size as usize * self.head_bytes()
    }

    /// Bytes of one block on a rank holding `heads` KV heads. Heads are the outermost dimension,
    /// so a rank's shard, and any contiguous range of heads, is one contiguous range of bytes.
    pub fn block_bytes(&self, heads: u32) -> usize {
        heads as usize * self.head_block_bytes()
    }

    /// Emulated compute for a prefill of `tokens` tokens.
    pub fn prefill_time(&self, tokens: usize) -> Duration {
        Duration::from_secs_f64((self.prefill_ms_per_token * tokens as f64 / 1e3).max(0.0))
    }

    pub fn decode_time(&self) -> Duration {
        Duration::from_secs_f64((self.decode_ms_per_token / 1e3).max(0.0))
    }

    /// Offset in a rank's block of token slot `slot`, local head `head`, `layer`, K (0) or V (1).
    pub fn kv_offset(&self, head: u32, layer: u32, kv: u32, slot: u32) -> usize {
        (((head * self.num_layers + layer) * 2 + kv) * self.block_size + slot) as usize * self.head_bytes()
    }

    /// Checks the shape; the message names the flag.
    pub fn validate(&self, tp_size: u32) -> Result<(), ConfigError> {
        for (v, flag) in [
            (self.num_layers, "--num-layers"),
            (self.num_kv_heads, "--num-kv-heads"),
            (self.head_dim, "--head-dim"),
            (self.dtype_bytes, "--dtype-bytes"),
            (self.block_size, "--block-size"),
            (self.max_model_len, "--max-model-len"),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(flag));
            }
        }
        if tp_size == 0 || !self.num_kv_heads.is_multiple_of(tp_size) {
            return Err(ConfigError::TpSize { tp_size, num_kv_heads: self.num_kv_heads });
        }
        if !(self.prefill_ms_per_token >= 0.0 && self.prefill_ms_per_token.is_finite()) {
            return Err(ConfigError::NotFinite("--prefill-ms-per-token"));
        }
        if !(self.decode_ms_per_token >= 0.0 && self.decode_ms_per_token.is_finite()) {
            return Err(ConfigError::NotFinite("--decode-ms-per-token"));
        }
        // Checked here so that the unchecked arithmetic everywhere else cannot overflow.
        let block = [self.num_kv_heads / tp_size, self.num_layers, 2, self.block_size, self.head_dim, self.dtype_bytes]
            .iter()
            .try_fold(1u64, |acc, &x| acc.checked_mul(u64::from(x)))
            .filter(|b| *b <= 64 << 20);
        if block.is_none() {
            return Err(ConfigError::BlockTooLarge);
        }
        Ok(())
    }
}

/// Text as tokens: each of the model's words after a space (`" lease"`, as
/// [`detokenize`] writes them) is one token when no letter or digit follows it; everything
/// else is UTF-8 bytes. So the text of an answer tokenizes back to the tokens that produced it,
/// as a real tokenizer's does: the next turn of a conversation starts with exactly the tokens
/// whose KV the decoder kept (SPEC B4).
pub fn tokenize(text: &str) -> Vec<u32> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b' ' {
            if let Some((token, len)) = word_at(&bytes[i + 1..]) {
                out.push(token);
                i += 1 + len;
                continue;
            }
        }
        out.push(u32::from(bytes[i]));
        i += 1;
    }
    out
}

/// The longest word of the model at the start of `rest` that no letter or digit continues.
/// Every word is letters only, so that is the word equal to the run of letters and digits at
/// the start of `rest`, if any: one comparison per word of that length, not a scan of `rest`
/// per word (tokenizing was a tenth of an engine's CPU per request, issue 15).
fn word_at(rest: &[u8]) -> Option<(u32, usize)> {
    let len = rest.iter().position(|c| !c.is_ascii_alphanumeric()).unwrap_or(rest.len());
    let run = &rest[..len];
    WORDS.iter().position(|w| w.as_bytes() == run).map(|i| (FIRST_WORD + i as u32, len))
}

/// The text of generated tokens (words, space-separated, as a tokenizer's leading spaces).
pub fn detokenize(token: u32) -> String {
    match token {
        0..=255 => String::from_utf8_lossy(&[token as u8]).into_owned(),
        t if t < EOS => format!(" {}", WORDS[(t - FIRST_WORD) as usize]),
        _ => String::new(),
    }
}

/// The chat template: one line per message, then the assistant's turn.
pub fn chat_prompt<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    s.push_str("<|assistant|>\n");
    s
}

/// The running hash of a token prefix: prefix_hash(tokens[..=i]).
pub fn extend_prefix(prev: u64, token: u32) -> u64 {
    mix(prev ^ (u64::from(token).wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

pub const PREFIX_SEED: u64 = 0x6b76_6c65_6173_6531;

/// Fills `out` with the KV bytes of one (head, layer, K|V) of the token whose prefix hash is
/// `prefix`. `head` is the global head index, so every TP layout writes the same bytes. Each
/// 8-byte word is a function of its index alone (counter mode), so the words are computed
/// independently, not as a chain.
pub fn kv_bytes(prefix: u64, head: u32, layer: u32, kv: u32, out: &mut [u8]) {
    let base = mix(prefix ^ (u64::from(head) << 40) ^ (u64::from(layer) << 20) ^ u64::from(kv) ^ 0x5eed);
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let word = mix(base.wrapping_add((i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
}

/// A 64-bit digest of bytes (fast enough to reread a sequence's KV every step): four
/// independent lanes of 8 bytes each per 32, folded, then the tail.
///
/// Kept out of line. When a change elsewhere (`pool::Blocks` behind an `Arc`) led the compiler
/// to inline it into `scheduler::digest_positions`, the same loop ran 2.4 times slower there,
/// its samples piled on the first load of each 32 bytes (`perf record` of P and D under 100
/// requests of the 16 MiB model: 2.0–2.5 ms a digest against 0.85), and time to first token
/// through P/D rose by 2–3 ms in pull, 1.5 ms in push.
#[inline(never)]
pub fn digest(seed: u64, bytes: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let h0 = seed ^ (bytes.len() as u64).wrapping_mul(0xff51_afd7_ed55_8ccd);
    let mut lanes = [h0, h0 ^ 0x243f_6a88_85a3_08d3, h0 ^ 0x1319_8a2e_0370_7344, h0 ^ 0xa409_3822_299f_31d0];
    let mut blocks = bytes.chunks_exact(32);
    for b in &mut blocks {
        for (j, lane) in lanes.iter_mut().enumerate() {
            let w = &b[8 * j..8 * j + 8];
            let v = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
            *lane = (*lane ^ v).wrapping_mul(K).rotate_left(29);
        }
    }
    let mut h = lanes.iter().enumerate().fold(0u64, |acc, (j, &l)| (acc ^ mix(l)).rotate_left(17 + j as u32));
    let rest = blocks.remainder();
    let mut words = rest.chunks_exact(8);
    for c in &mut words {
        let v = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ v).wrapping_mul(K).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(K);
    }
    mix(h)
}

/// The seed of one piece of a sequence's KV digest: the [`digest`] of one (global head, layer,
/// K|V)'s bytes over the positions of one block from `pos` on. Keyed by where the piece sits, so
/// the pieces may be read in any order (the pool's memory order, whatever the TP layout) and
/// summed; [`fold_pieces`] ends the sum.
pub fn piece_seed(seed: u64, head: u32, layer: u32, kv: u32, pos: usize) -> u64 {
    mix(seed
        ^ mix((u64::from(head) << 40) ^ (u64::from(layer) << 20) ^ (u64::from(kv) << 8) ^ 0x7069_6563)
        ^ (pos as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// A KV digest from the wrapping sum of its pieces' digests (see [`piece_seed`]).
pub fn fold_pieces(seed: u64, sum: u64) -> u64 {
    mix(seed.rotate_left(23) ^ sum)
}

/// The token generated from a KV digest, and the digest carried to the next step.
pub fn next_token(kv_digest: u64) -> u32 {
    let h = mix(kv_digest ^ 0x746f_6b65_6e21);
    if h.is_multiple_of(97) {
        EOS
    } else {
        FIRST_WORD + (h % WORDS.len() as u64) as u32
    }
}

/// Tokens the model can generate: the words, then EOS.
pub const GENERABLE: u32 = EOS + 1 - FIRST_WORD;

/// The model's logits over the generable tokens (index i is token `FIRST_WORD + i`), from the
/// digest of the KV read back. The most likely token is [`next_token`]'s, so greedy decoding
/// is what the model always produced.
pub fn logits(kv_digest: u64) -> Vec<f64> {
    let top = next_token(kv_digest);
    (FIRST_WORD..=EOS)
        .map(|t| if t == top { 0.0 } else { -(0.5 + 4.0 * unit(mix(kv_digest ^ u64::from(t).wrapping_mul(0xa24b_aed4_963e_e407)))) })
        .collect()
}

/// Log-softmax of logits (entries of -inf stay -inf).
pub fn log_softmax(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|l| l - lse).collect()
}

/// How to pick among the logits (the model-side half of vLLM's sampling parameters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: u32,
    pub seed: u64,
}

/// Picks the token at output position `position`: greedy at temperature 0, else a draw from
/// the tempered, top-k and top-p filtered distribution with a uniform number that is a pure
/// function of (seed, position). `banned` tokens (EOS and stop ids under `min_tokens`) cannot
/// be picked unless nothing else could.
pub fn choose(kv_digest: u64, s: &Sampler, position: u32, banned: impl Fn(u32) -> bool) -> u32 {
    // Greedy: the most likely token is `next_token`'s (see `logits`); no allocation per token.
    if s.temperature < 1e-5 {
        let top = next_token(kv_digest);
        if !banned(top) {
            return top;
        }
    }
    let raw = logits(kv_digest);
    let mut cand: Vec<(u32, f64)> = raw.iter().enumerate().map(|(i, &l)| (FIRST_WORD + i as u32, l)).filter(|(t, _)| !banned(*t)).collect();
    if cand.is_empty() {
        return next_token(kv_digest);
    }
    // Most likely first; ties (none in practice) by token id, so the order is total.
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if s.temperature < 1e-5 {
        return cand[0].0;
    }
    if s.top_k > 0 {
        cand.truncate(s.top_k as usize);
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand.iter().map(|(_, l)| ((l - max) / s.temperature).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if s.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                acc += p;
                acc >= s.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let u = unit(mix(s.seed ^ mix(u64::from(position).wrapping_add(0x5a4d_504c_4552_2121))));
    let mut acc = 0.0;
    for (i, p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

/// A uniform number in [0, 1) from 53 bits of `h`.
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_bytes_depend_on_prefix_head_layer_kv() {
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        kv_bytes(1, 0, 0, 0, &mut a);
        for (p, h, l, k) in [(2, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 0), (1, 0, 0, 1)] {
            kv_bytes(p, h, l, k, &mut b);
            assert_ne!(a, b);
        }
        kv_bytes(1, 0, 0, 0, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn digest_sees_every_byte() {
        let mut v = vec![7u8; 1001];
        let d = digest(0, &v);
        for i in [0, 8, 16, 24, 31, 32, 500, 991, 992, 999, 1000] {
            v[i] ^= 1;
            assert_ne!(digest(0, &v), d, "byte {i}");
            v[i] ^= 1;
        }
    }

    /// A KV digest is a sum of pieces read in any order, but each piece is keyed by where it
    /// sits: KV in the wrong block or under the wrong head, layer or K/V (a mangled block list)
    /// digests differently, and no two pieces of a large model share a seed.
    #[test]
    fn a_kv_digest_sees_where_each_piece_sits() {
        let (a, b) = ([1u8; 64], [2u8; 64]);
        let at = |head, pos| piece_seed(7, head, 3, 1, pos);
        let right = fold_pieces(7, digest(at(0, 0), &a).wrapping_add(digest(at(0, 16), &b)));
        let reordered = fold_pieces(7, digest(at(0, 16), &b).wrapping_add(digest(at(0, 0), &a)));
        assert_eq!(right, reordered, "the order the pieces are read in does not matter");
        let swapped = fold_pieces(7, digest(at(0, 0), &b).wrapping_add(digest(at(0, 16), &a)));
        assert_ne!(right, swapped, "blocks swapped");
        let other_head = fold_pieces(7, digest(at(1, 0), &a).wrapping_add(digest(at(0, 16), &b)));
        assert_ne!(right, other_head, "a head's bytes under another head");
        let mut seen = std::collections::HashSet::new();
        for head in 0..8 {
            for layer in 0..16 {
                for kv in 0..2 {
                    for pos in (0..4096).step_by(16) {
                        assert!(seen.insert(piece_seed(0, head, layer, kv, pos)), "{head} {layer} {kv} {pos}");
                    }
                }
            }
        }
    }

    #[test]
    fn tokens_and_text() {
        assert_eq!(tokenize("hi"), vec![104, 105]);
        assert_eq!(detokenize(104), "h");
        assert_eq!(detokenize(FIRST_WORD), " the");
        assert_eq!(detokenize(EOS), "");
        assert!(next_token(42) >= FIRST_WORD && next_token(42) <= EOS);
        assert_eq!(chat_prompt([("user", "hi")]), "<|user|>\nhi\n<|assistant|>\n");
    }

    /// SPEC B4: an answer's text tokenizes back to the tokens that produced it, so the next turn
    /// of a conversation starts with exactly the tokens whose KV the decoder kept; a word that a
    /// letter continues is bytes.
    #[test]
    fn b4_answers_tokenize_back_to_their_tokens() {
        let answer: Vec<u32> = (FIRST_WORD..EOS).collect();
        let text: String = answer.iter().map(|&t| detokenize(t)).collect();
        assert_eq!(tokenize(&text), answer);
        let thunder = FIRST_WORD + WORDS.iter().position(|w| *w == "thunder").unwrap() as u32;
        assert_eq!(tokenize(" thunder"), vec![thunder], "the longest word wins over its prefix");
        assert_eq!(
            tokenize(" theory"),
            tokenize("theory").into_iter().fold(vec![32], |mut v, t| {
                v.push(t);
                v
            })
        );
        assert_eq!(tokenize(" the."), vec![FIRST_WORD, u32::from(b'.')]);
    }

    /// `word_at` finds the word equal to the letter run, which is the longest word no letter
    /// continues only because every word is letters: checked here, and against that definition
    /// on text that mixes words, prefixes, extensions and punctuation.
    #[test]
    fn b4_word_lookup_is_the_longest_uncontinued_word() {
        assert!(WORDS.iter().all(|w| !w.is_empty() && w.bytes().all(|c| c.is_ascii_alphabetic())));
        let longest = |rest: &[u8]| {
            WORDS
                .iter()
                .enumerate()
                .filter(|(_, w)| rest.starts_with(w.as_bytes()) && rest.get(w.len()).is_none_or(|c| !c.is_ascii_alphanumeric()))
                .max_by_key(|(_, w)| w.len())
                .map(|(i, w)| (FIRST_WORD + i as u32, w.len()))
        };
        let mut pieces: Vec<String> = WORDS.iter().map(|w| w.to_string()).collect();
        pieces.extend(WORDS.iter().map(|w| format!("{w}s")));
        pieces.extend(WORDS.iter().map(|w| w[..w.len() - 1].to_string()));
        pieces.extend(["the.", "lease,", "x", "2", "thunder9", "", "é", "decode-prefill"].map(String::from));
        for p in &pieces {
            assert_eq!(word_at(p.as_bytes()), longest(p.as_bytes()), "{p:?}");
        }
    }

    fn sampler(temperature: f64, top_p: f64, top_k: u32, seed: u64) -> Sampler {
        Sampler { temperature, top_p, top_k, seed }
    }

    #[test]
    fn greedy_is_the_models_token_and_sampling_is_seeded() {
        for d in 0..200u64 {
            let d = mix(d);
            assert_eq!(choose(d, &sampler(0.0, 1.0, 0, 7), 3, |_| false), next_token(d));
            assert_eq!(choose(d, &sampler(5.0, 1.0, 1, 7), 3, |_| false), next_token(d), "top_k 1 is greedy");
            assert_eq!(choose(d, &sampler(5.0, 1e-9, 0, 7), 3, |_| false), next_token(d), "tiny top_p is greedy");
            let a = choose(d, &sampler(1.0, 0.9, 0, 7), 3, |_| false);
            assert_eq!(a, choose(d, &sampler(1.0, 0.9, 0, 7), 3, |_| false), "same seed, same token");
            let banned = next_token(d);
            assert_ne!(choose(d, &sampler(0.0, 1.0, 0, 7), 3, |t| t == banned), banned);
        }
        let picks: std::collections::HashSet<u32> =
            (0..200).map(|seed| choose(mix(5), &sampler(2.0, 1.0, 0, seed), 0, |_| false)).collect();
        assert!(picks.len() > 10, "a hot temperature spreads over the vocabulary: {}", picks.len());
        let lp = log_softmax(&logits(mix(5)));
        assert!((lp.iter().map(|l| l.exp()).sum::<f64>() - 1.0).abs() < 1e-9);
        assert_eq!(lp.len(), GENERABLE as usize);
    }

    #[test]
    fn validate_names_the_flag() {
        let m = ModelConfig::default();
        assert!(m.validate(1).is_ok() && m.validate(4).is_ok());
        let refused = |m: ModelConfig, tp: u32| m.validate(tp).map_err(|e| e.to_string()).unwrap_err();
        assert_eq!(refused(m.clone(), 3), format!("--tp-size 3 must divide --num-kv-heads {}", m.num_kv_heads));
        assert_eq!(refused(ModelConfig { block_size: 0, ..m.clone() }, 1), "--block-size must be at least 1");
        assert_eq!(
            refused(ModelConfig { decode_ms_per_token: f64::NAN, ..m.clone() }, 1),
            "--decode-ms-per-token must be a finite number ≥ 0"
        );
        assert_eq!(
            refused(ModelConfig { prefill_ms_per_token: -1.0, ..m.clone() }, 1),
            "--prefill-ms-per-token must be a finite number ≥ 0"
        );
        assert!(refused(ModelConfig { head_dim: 65536, dtype_bytes: 65536, ..m.clone() }, 1).contains("64 MiB"));
        assert!(refused(ModelConfig { num_layers: u32::MAX, block_size: u32::MAX, ..m }, 1).contains("64 MiB"));
    }
}
