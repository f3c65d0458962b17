//! The metadata a [`super::NixlAgent`] hands to its peers: NIXL's own agent metadata (which
//! NIXL needs to reach us) wrapped with what NIXL's metadata does not tell in a usable form —
//! where our arena starts and how it is cut into blocks. A reader turns a segment into a remote
//! address with it: `base + remote_block * block_bytes + remote_offset`.
//!
//! Layout (integers little-endian):
//! `"KVLN"`, version `1`, name (`u16` length + UTF-8), `base: u64`, `num_blocks: u32`,
//! `block_bytes: u64`, NIXL metadata (`u32` length + bytes), then an FNV-1a 64 checksum of all
//! bytes before it. Decoding is total: any other input is [`TransportError::BadMetadata`]. The
//! checksum catches a damaged envelope before NIXL sees it: NIXL accepts some corrupted
//! metadata and then refuses the good one for the same agent.
//!
//! And the envelope of every notification (SPEC S2): `payload · counter: u64 · tag (32)`, the
//! tag being HMAC-SHA256 under the pair's key of `counter · payload` (see the crate's `auth`
//! module and the nixl module doc). The trailer goes last so the payload stays where it is.

use crate::auth::NotifKey;
use crate::TransportError;
use kvlease_core::auth::TAG_LEN;

const MAGIC: &[u8; 4] = b"KVLN";
const VERSION: u8 = 1;
/// Longest agent name, in bytes.
pub(crate) const MAX_NAME: usize = 1024;
/// Largest NIXL metadata accepted (NIXL's is a few hundred bytes per backend).
const MAX_NIXL_MD: usize = 1024 * 1024;

/// A peer's decoded metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerMd {
    pub name: String,
    /// Address of the peer's arena in the peer's address space.
    pub base: u64,
    pub num_blocks: u32,
    pub block_bytes: u64,
    /// What NIXL's `load_remote_md` takes.
    pub nixl_md: Vec<u8>,
}

impl PeerMd {
    /// The remote address of `len` bytes at `offset` in `block`, if they lie inside the
    /// peer's advertised arena.
    pub fn addr(&self, block: u32, offset: u32, len: u32) -> Option<u64> {
        if block >= self.num_blocks || u64::from(offset) + u64::from(len) > self.block_bytes {
            return None;
        }
        // Cannot overflow: decoding checked base + num_blocks * block_bytes.
        Some(self.base + u64::from(block) * self.block_bytes + u64::from(offset))
    }
}

pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME && !name.contains('\0')
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

pub(crate) fn encode(md: &PeerMd) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 1 + 2 + md.name.len() + 8 + 4 + 8 + 4 + md.nixl_md.len() + 8);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    // Names are checked at start-up (`valid_name`), so the length fits a u16.
    out.extend_from_slice(&(md.name.len() as u16).to_le_bytes());
    out.extend_from_slice(md.name.as_bytes());
    out.extend_from_slice(&md.base.to_le_bytes());
    out.extend_from_slice(&md.num_blocks.to_le_bytes());
    out.extend_from_slice(&md.block_bytes.to_le_bytes());
    out.extend_from_slice(&(md.nixl_md.len() as u32).to_le_bytes());
    out.extend_from_slice(&md.nixl_md);
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], TransportError> {
        if self.rest.len() < n {
            return Err(bad(format!("truncated in {what}")));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], TransportError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
}

fn bad(msg: impl std::fmt::Display) -> TransportError {
    TransportError::BadMetadata(format!("NIXL agent metadata: {msg}"))
}

pub(crate) fn decode(bytes: &[u8]) -> Result<PeerMd, TransportError> {
    if bytes.len() < MAGIC.len() + 1 + 8 {
        return Err(bad(format!("{} bytes is too short", bytes.len())));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if bytes[..MAGIC.len()] != MAGIC[..] {
        return Err(bad("not a kvlease NIXL envelope (wrong magic; metadata of another backend?)"));
    }
    let mut sum_bytes = [0u8; 8];
    sum_bytes.copy_from_slice(sum);
    if fnv1a(body) != u64::from_le_bytes(sum_bytes) {
        return Err(bad("checksum mismatch (damaged in transit)"));
    }
    let mut r = Reader { rest: &body[MAGIC.len()..] };
    let [version] = r.array::<1>("version")?;
    if version != VERSION {
        return Err(bad(format!("version {version}, this build reads {VERSION}")));
    }
    let name_len = u16::from_le_bytes(r.array("name length")?) as usize;
    let name = std::str::from_utf8(r.take(name_len, "name")?).map_err(|_| bad("agent name is not UTF-8"))?.to_owned();
    if !valid_name(&name) {
        return Err(bad(format!("agent names are 1 to {MAX_NAME} bytes without NUL")));
    }
    let base = u64::from_le_bytes(r.array("base address")?);
    let num_blocks = u32::from_le_bytes(r.array("block count")?);
    let block_bytes = u64::from_le_bytes(r.array("block size")?);
    if num_blocks == 0 || block_bytes == 0 {
        return Err(bad(format!("empty arena ({num_blocks} blocks of {block_bytes} bytes)")));
    }
    let fits = u64::from(num_blocks).checked_mul(block_bytes).and_then(|size| base.checked_add(size)).is_some();
    if !fits {
        return Err(bad(format!("arena of {num_blocks} blocks of {block_bytes} bytes at {base:#x} overflows the address space")));
    }
    let md_len = u32::from_le_bytes(r.array("NIXL metadata length")?) as usize;
    if md_len == 0 || md_len > MAX_NIXL_MD {
        return Err(bad(format!("NIXL metadata of {md_len} bytes (1 to {MAX_NIXL_MD} expected)")));
    }
    let nixl_md = r.take(md_len, "NIXL metadata")?.to_vec();
    if !r.rest.is_empty() {
        return Err(bad(format!("{} trailing bytes", r.rest.len())));
    }
    Ok(PeerMd { name, base, num_blocks, block_bytes, nixl_md })
}

/// Bytes a notification carries after its payload.
pub(crate) const NOTIF_TRAILER: usize = 8 + TAG_LEN;

/// A notification as sent: the payload, the sender's counter for this receiver, and the tag.
pub(crate) fn seal_notif(mut payload: Vec<u8>, counter: u64, key: &NotifKey) -> Vec<u8> {
    let tag = key.tag(counter, &payload);
    payload.reserve_exact(NOTIF_TRAILER);
    payload.extend_from_slice(&counter.to_le_bytes());
    payload.extend_from_slice(&tag);
    payload
}

/// `(payload length, counter, tag)` of a received notification; `None` if it is too short to
/// carry a trailer. Says nothing of the tag's worth: that is the receiver's to check.
pub(crate) fn split_notif(bytes: &[u8]) -> Option<(usize, u64, &[u8])> {
    let len = bytes.len().checked_sub(NOTIF_TRAILER)?;
    let (counter, tag) = bytes[len..].split_at(8);
    Some((len, u64::from_le_bytes(counter.try_into().ok()?), tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PeerMd {
        PeerMd { name: "eng-p/1/0".into(), base: 0x7f00_0000_0000, num_blocks: 16, block_bytes: 4096, nixl_md: b"nixlSerDes|...".to_vec() }
    }

    #[test]
    fn round_trips() {
        let md = sample();
        assert_eq!(decode(&encode(&md)), Ok(md));
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_bad_metadata() {
        let bytes = encode(&sample());
        for n in 0..bytes.len() {
            assert!(matches!(decode(&bytes[..n]), Err(TransportError::BadMetadata(_))), "truncated to {n}");
        }
        for i in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut b = bytes.clone();
                b[i] ^= bit;
                assert!(matches!(decode(&b), Err(TransportError::BadMetadata(_))), "byte {i} flipped by {bit:#x}");
            }
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
    }

    /// Well-formed envelopes (valid checksum) with bad fields are refused too.
    #[test]
    fn bad_fields_are_refused() {
        let cases = [
            PeerMd { name: String::new(), ..sample() },
            PeerMd { name: "a\0b".into(), ..sample() },
            PeerMd { num_blocks: 0, ..sample() },
            PeerMd { block_bytes: 0, ..sample() },
            PeerMd { base: u64::MAX - 10, ..sample() },
            PeerMd { block_bytes: u64::MAX, ..sample() },
            PeerMd { nixl_md: Vec::new(), ..sample() },
        ];
        for md in cases {
            assert!(matches!(decode(&encode(&md)), Err(TransportError::BadMetadata(_))), "{md:?}");
        }
        assert!(decode(b"").is_err());
        assert!(decode(&[0xffu8; 64]).is_err());
        // A tcp agent's metadata is not ours.
        assert!(decode(b"\x00\x01KVLT....................").is_err());
    }

    #[test]
    fn notifications_are_sealed_and_split_s2() {
        let key = NotifKey::new(&kvlease_core::auth::ClusterKey::new(Some(b"s")), "d", "p");
        let sealed = seal_notif(b"heartbeat".to_vec(), 7, &key);
        assert_eq!(sealed.len(), 9 + NOTIF_TRAILER);
        let (len, counter, tag) = split_notif(&sealed).expect("a trailer");
        assert_eq!((&sealed[..len], counter), (&b"heartbeat"[..], 7));
        assert!(key.verify(counter, &sealed[..len], tag));
        let empty = seal_notif(Vec::new(), 1, &key);
        assert_eq!(split_notif(&empty).map(|(len, c, _)| (len, c)), Some((0, 1)));
        assert_eq!(split_notif(&empty[1..]), None, "too short for a trailer");
    }

    #[test]
    fn remote_addresses_stay_inside_the_advertised_arena() {
        let md = sample();
        assert_eq!(md.addr(0, 0, 4096), Some(md.base));
        assert_eq!(md.addr(3, 100, 10), Some(md.base + 3 * 4096 + 100));
        assert_eq!(md.addr(15, 4096, 0), Some(md.base + 15 * 4096 + 4096));
        assert_eq!(md.addr(16, 0, 1), None);
        assert_eq!(md.addr(0, 4000, 97), None);
        assert_eq!(md.addr(0, u32::MAX, u32::MAX), None);
    }
}
