//! The framed, versioned binary protocol spoken over tcp and Unix-socket connections.
//!
//! Every frame is an 8-byte header — magic `"RK"`, protocol version, frame kind, body length
//! (u32 LE) — followed by the body. Integers are little-endian. Decoders never trust a length:
//! each is checked against what remains, bodies are bounded by [`MAX_FRAME_BODY`], and any
//! inconsistency is a [`WireError`] (the connection is then closed, with the reason logged).
//!
//! Verbs request body: `seq u64, count u16`, then per request `op u8, rkey u32, offset u64` and
//! the operands (`len u32` for READ; `len u32` + bytes for WRITE; one, two or four `u64` for the
//! atomics). Verbs response body: `seq u64, count u16`, then `count` records of `status u8,
//! value u64` (READ: length; atomics: old value; failure: detail), then the READ data in order.

use std::borrow::Cow;
use std::io::{Read, Write};

use crate::region::RegionInfo;
use crate::wr::{Access, Opcode, RemoteAddr, WorkRequest, MAX_BATCH_BYTES, MAX_BATCH_REQUESTS};

pub const MAGIC: [u8; 2] = *b"RK";
pub const VERSION: u8 = 4;
pub const HEADER_LEN: usize = 8;
/// Largest frame body accepted: a maximal batch plus its per-request headers.
pub const MAX_FRAME_BODY: u32 = MAX_BATCH_BYTES as u32 + 64 * MAX_BATCH_REQUESTS as u32;
/// Per-request record in a verbs response: status u8 + value u64.
pub const OUTCOME_LEN: usize = 9;
pub const RESPONSE_PREFIX: usize = 10;

/// Kinds of frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Hello = 1,
    Challenge = 2,
    Proof = 3,
    Welcome = 4,
    Refused = 5,
    ShmRegions = 6,
    /// rdma: the client's queue pair (after Welcome).
    RdmaConnect = 7,
    /// rdma: the node's queue pair and its registrations.
    RdmaAccept = 8,
    VerbsRequest = 16,
    VerbsResponse = 17,
    ControlRequest = 32,
    ControlResponse = 33,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        use FrameKind::*;
        [
            Hello,
            Challenge,
            Proof,
            Welcome,
            Refused,
            ShmRegions,
            RdmaConnect,
            RdmaAccept,
            VerbsRequest,
            VerbsResponse,
            ControlRequest,
            ControlResponse,
        ]
        .into_iter()
        .find(|k| *k as u8 == v)
    }
}

/// Why a byte stream is not a valid frame sequence.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("peer closed the connection")]
    Closed,
    #[error("bad magic {0:02x?}: not a RackFS peer")]
    BadMagic([u8; 2]),
    #[error("unsupported protocol version {got}; this side speaks version {VERSION}")]
    UnsupportedVersion { got: u8 },
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: u32, max: u32 },
    #[error("malformed {what}: {why}")]
    Malformed { what: &'static str, why: String },
    #[error("expected a {expected:?} frame, got {got:?}")]
    Unexpected { expected: FrameKind, got: FrameKind },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl WireError {
    pub fn malformed(what: &'static str, why: impl Into<String>) -> WireError {
        WireError::Malformed {
            what,
            why: why.into(),
        }
    }
}

pub fn encode_header(kind: FrameKind, body_len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..2].copy_from_slice(&MAGIC);
    h[2] = VERSION;
    h[3] = kind as u8;
    h[4..8].copy_from_slice(&(body_len as u32).to_le_bytes());
    h
}

/// Validates a header and returns the frame kind and body length.
pub fn decode_header(h: &[u8; HEADER_LEN]) -> Result<(FrameKind, u32), WireError> {
    if h[0..2] != MAGIC {
        return Err(WireError::BadMagic([h[0], h[1]]));
    }
    if h[2] != VERSION {
        return Err(WireError::UnsupportedVersion { got: h[2] });
    }
    let kind = FrameKind::from_u8(h[3]).ok_or(WireError::UnknownKind(h[3]))?;
    let len = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
    if len > MAX_FRAME_BODY {
        return Err(WireError::TooLarge {
            len,
            max: MAX_FRAME_BODY,
        });
    }
    Ok((kind, len))
}

/// Reads one frame into `body` (replacing its contents). EOF before a header is [`WireError::Closed`].
///
/// The body is read straight into `body`'s spare room, never zeroed first: for a 1 MiB write
/// that memset would cost as much as the copy itself.
pub fn read_frame<R: Read + ?Sized>(r: &mut R, body: &mut Vec<u8>) -> Result<FrameKind, WireError> {
    let (kind, len) = read_header(r)?;
    body.clear();
    body.reserve_exact(len);
    r.take(len as u64).read_to_end(body)?;
    if body.len() < len {
        return Err(WireError::malformed(
            "frame body",
            "truncated by end of stream",
        ));
    }
    Ok(kind)
}

fn read_header<R: Read + ?Sized>(r: &mut R) -> Result<(FrameKind, usize), WireError> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Err(WireError::Closed),
            Ok(0) => {
                return Err(WireError::malformed(
                    "frame header",
                    "truncated by end of stream",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let (kind, len) = decode_header(&h)?;
    Ok((kind, len as usize))
}

/// Reads one frame and insists on its kind; a `Refused` frame becomes its reason.
pub fn expect_frame<R: Read + ?Sized>(
    r: &mut R,
    expected: FrameKind,
) -> Result<Vec<u8>, WireError> {
    let mut body = Vec::new();
    let kind = read_frame(r, &mut body)?;
    if kind != expected {
        if kind == FrameKind::Refused {
            let reason = Cursor::new(&body, "refusal").str()?;
            return Err(WireError::malformed(
                "handshake",
                format!("refused by peer: {reason}"),
            ));
        }
        return Err(WireError::Unexpected {
            expected,
            got: kind,
        });
    }
    Ok(body)
}

pub fn write_frame<W: Write + ?Sized>(
    w: &mut W,
    kind: FrameKind,
    body: &[u8],
) -> std::io::Result<()> {
    w.write_all(&encode_header(kind, body.len()))?;
    w.write_all(body)
}

/// A bounds-checked little-endian reader over a frame body.
pub struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Cursor { buf, pos: 0, what }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.remaining() < n {
            return Err(WireError::malformed(
                self.what,
                format!(
                    "needs {n} more bytes at offset {}, has {}",
                    self.pos,
                    self.remaining()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2")))
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4")))
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8")))
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        Ok(self.bytes(N)?.try_into().expect("N"))
    }
    /// A u16-length-prefixed UTF-8 string.
    pub fn str(&mut self) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| WireError::malformed(self.what, "string is not UTF-8"))
    }
    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<(), WireError> {
        if self.remaining() != 0 {
            return Err(WireError::malformed(
                self.what,
                format!("{} trailing bytes", self.remaining()),
            ));
        }
        Ok(())
    }
}

/// Appends a u16-length-prefixed string (truncated to 65535 bytes at a char boundary).
pub fn put_str(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// Appends the body of a verbs request frame.
/// What a verbs request carries besides its work requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchHead {
    /// Position of the batch on its connection (responses come back in order).
    pub seq: u64,
    /// The client's wall clock when it sent the batch, ns since the epoch.
    pub sent_ns: u64,
    /// How long the client waits for the answer (0: forever). A node that finds a batch
    /// older than this (a stopped node, resumed) closes the connection instead of executing
    /// it: the client gave up on it and told its application the operation failed.
    pub deadline_ms: u32,
}

pub fn encode_verbs_request(out: &mut Vec<u8>, head: &BatchHead, requests: &[WorkRequest<'_>]) {
    let apart = encode_verbs_request_apart(out, head, requests, usize::MAX);
    debug_assert!(apart.is_empty());
}

/// [`encode_verbs_request`], leaving out of `out` every WRITE payload of at least `apart_from`
/// bytes: each is returned with the position in `out` where its bytes belong, so a sender can
/// hand them to one vectored write instead of copying them first.
pub fn encode_verbs_request_apart<'r>(
    out: &mut Vec<u8>,
    head: &BatchHead,
    requests: &'r [WorkRequest<'_>],
    apart_from: usize,
) -> Vec<(usize, &'r [u8])> {
    let mut apart = Vec::new();
    out.extend_from_slice(&head.seq.to_le_bytes());
    out.extend_from_slice(&head.sent_ns.to_le_bytes());
    out.extend_from_slice(&head.deadline_ms.to_le_bytes());
    out.extend_from_slice(&(requests.len() as u16).to_le_bytes());
    for wr in requests {
        let addr = wr.addr();
        out.push(wr.opcode() as u8);
        out.extend_from_slice(&addr.rkey.to_le_bytes());
        out.extend_from_slice(&addr.offset.to_le_bytes());
        let words: &[u64] = match wr {
            WorkRequest::Read { len, .. } => {
                out.extend_from_slice(&len.to_le_bytes());
                &[]
            }
            WorkRequest::Write { data, .. } => {
                out.extend_from_slice(&(data.len() as u32).to_le_bytes());
                if data.len() >= apart_from {
                    apart.push((out.len(), data.as_ref()));
                } else {
                    out.extend_from_slice(data);
                }
                &[]
            }
            WorkRequest::Cas { compare, swap, .. } => &[*compare, *swap],
            WorkRequest::Faa { add, .. } => &[*add],
            WorkRequest::MaskedCas {
                compare,
                compare_mask,
                swap,
                swap_mask,
                ..
            } => &[*compare, *compare_mask, *swap, *swap_mask],
            WorkRequest::MaskedFaa { add, boundary, .. } => &[*add, *boundary],
        };
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    apart
}

/// Decodes a verbs request body; WRITE payloads borrow from `body`.
pub fn decode_verbs_request(body: &[u8]) -> Result<(BatchHead, Vec<WorkRequest<'_>>), WireError> {
    let mut c = Cursor::new(body, "verbs request");
    let head = BatchHead {
        seq: c.u64()?,
        sent_ns: c.u64()?,
        deadline_ms: c.u32()?,
    };
    let count = c.u16()? as usize;
    if count > MAX_BATCH_REQUESTS {
        return Err(WireError::malformed(
            "verbs request",
            format!("{count} requests exceed the batch limit of {MAX_BATCH_REQUESTS}"),
        ));
    }
    let mut requests = Vec::with_capacity(count);
    let mut read_bytes = 0u64;
    for _ in 0..count {
        let op_byte = c.u8()?;
        let op = Opcode::from_u8(op_byte).ok_or_else(|| {
            WireError::malformed("verbs request", format!("unknown opcode {op_byte}"))
        })?;
        let addr = RemoteAddr::new(c.u32()?, c.u64()?);
        requests.push(match op {
            Opcode::Read => {
                let len = c.u32()?;
                read_bytes += len as u64;
                WorkRequest::Read { addr, len }
            }
            Opcode::Write => {
                let len = c.u32()? as usize;
                WorkRequest::Write {
                    addr,
                    data: Cow::Borrowed(c.bytes(len)?),
                }
            }
            Opcode::Cas => WorkRequest::Cas {
                addr,
                compare: c.u64()?,
                swap: c.u64()?,
            },
            Opcode::Faa => WorkRequest::Faa {
                addr,
                add: c.u64()?,
            },
            Opcode::MaskedCas => WorkRequest::MaskedCas {
                addr,
                compare: c.u64()?,
                compare_mask: c.u64()?,
                swap: c.u64()?,
                swap_mask: c.u64()?,
            },
            Opcode::MaskedFaa => WorkRequest::MaskedFaa {
                addr,
                add: c.u64()?,
                boundary: c.u64()?,
            },
        });
    }
    c.finish()?;
    if read_bytes > MAX_BATCH_BYTES {
        return Err(WireError::malformed(
            "verbs request",
            format!("READs ask for {read_bytes} bytes, the batch limit is {MAX_BATCH_BYTES}"),
        ));
    }
    Ok((head, requests))
}

/// Which service a connection asks for in its hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ConnKind {
    /// Work requests executed by the node's NIC threads.
    Verbs = 1,
    /// Control RPCs (allocation, metadata, stats).
    Control = 2,
    /// Map the regions' memfds (Unix socket only); the connection then only signals liveness.
    Shm = 3,
    /// Set up an RDMA RC queue pair (TCP only); the connection then only signals liveness.
    Rdma = 4,
}

impl ConnKind {
    pub fn from_u8(v: u8) -> Option<ConnKind> {
        [
            ConnKind::Verbs,
            ConnKind::Control,
            ConnKind::Shm,
            ConnKind::Rdma,
        ]
        .into_iter()
        .find(|k| *k as u8 == v)
    }
}

pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub kind: ConnKind,
    pub nonce: [u8; NONCE_LEN],
    pub client_name: String,
    /// The token under which the node may fence this client's connections (0: none); a
    /// mount's is its session on the primary, fenced when its lease expires.
    pub fence: u64,
    /// The client's wall clock when it sent this (ns since the epoch): a verbs connection's
    /// first clock-offset sample, so even its first batch is judged for lateness.
    pub sent_ns: u64,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![self.kind as u8];
        b.extend_from_slice(&self.nonce);
        put_str(&mut b, &self.client_name);
        b.extend_from_slice(&self.fence.to_le_bytes());
        b.extend_from_slice(&self.sent_ns.to_le_bytes());
        b
    }
    pub fn decode(body: &[u8]) -> Result<Hello, WireError> {
        let mut c = Cursor::new(body, "hello");
        let k = c.u8()?;
        let kind = ConnKind::from_u8(k)
            .ok_or_else(|| WireError::malformed("hello", format!("unknown connection kind {k}")))?;
        let hello = Hello {
            kind,
            nonce: c.array()?,
            client_name: c.str()?,
            fence: c.u64()?,
            sent_ns: c.u64()?,
        };
        c.finish()?;
        Ok(hello)
    }
}

/// The node's nonce, and nothing else: a peer that has not proven the secret learns nothing
/// from the node it could test guesses of the secret against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub nonce: [u8; NONCE_LEN],
}

impl Challenge {
    pub fn encode(&self) -> Vec<u8> {
        self.nonce.to_vec()
    }
    pub fn decode(body: &[u8]) -> Result<Challenge, WireError> {
        let mut c = Cursor::new(body, "challenge");
        let ch = Challenge { nonce: c.array()? };
        c.finish()?;
        Ok(ch)
    }
}

/// The server's acceptance, once the client has proven the secret: its own proof, who it is
/// and which regions it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub proof: [u8; PROOF_LEN],
    pub node_name: String,
    pub node_id: u32,
    pub regions: Vec<RegionInfo>,
}

impl Welcome {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = self.proof.to_vec();
        put_str(&mut b, &self.node_name);
        b.extend_from_slice(&self.node_id.to_le_bytes());
        b.extend_from_slice(&(self.regions.len() as u16).to_le_bytes());
        for r in &self.regions {
            b.extend_from_slice(&r.rkey.to_le_bytes());
            b.extend_from_slice(&r.len.to_le_bytes());
            b.push(r.access.bits());
        }
        b
    }
    pub fn decode(body: &[u8]) -> Result<Welcome, WireError> {
        let mut c = Cursor::new(body, "welcome");
        let proof = c.array()?;
        let node_name = c.str()?;
        let node_id = c.u32()?;
        let n = c.u16()? as usize;
        let mut regions = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            regions.push(RegionInfo {
                rkey: c.u32()?,
                len: c.u64()?,
                access: Access::from_bits(c.u8()?),
            });
        }
        c.finish()?;
        Ok(Welcome {
            proof,
            node_name,
            node_id,
            regions,
        })
    }
}

/// One end of an RDMA RC connection, as exchanged over the control channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaEndpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

impl RdmaEndpoint {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
    }
    pub fn decode(c: &mut Cursor<'_>) -> Result<RdmaEndpoint, WireError> {
        Ok(RdmaEndpoint {
            qpn: c.u32()?,
            psn: c.u32()? & 0xff_ffff,
            lid: c.u16()?,
            gid: c.array()?,
        })
    }
}

/// The node's answer to [`FrameKind::RdmaConnect`]: its queue pair, what its device does
/// with atomics, and per region (our key) the registration's address and RDMA rkey.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaAccept {
    pub endpoint: RdmaEndpoint,
    pub atomics: String,
    pub regions: Vec<(u32, u64, u32)>,
}

impl RdmaAccept {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        self.endpoint.encode(&mut b);
        put_str(&mut b, &self.atomics);
        b.extend_from_slice(&(self.regions.len() as u16).to_le_bytes());
        for (key, addr, rkey) in &self.regions {
            b.extend_from_slice(&key.to_le_bytes());
            b.extend_from_slice(&addr.to_le_bytes());
            b.extend_from_slice(&rkey.to_le_bytes());
        }
        b
    }
    pub fn decode(body: &[u8]) -> Result<RdmaAccept, WireError> {
        let mut c = Cursor::new(body, "rdma accept");
        let endpoint = RdmaEndpoint::decode(&mut c)?;
        let atomics = c.str()?;
        let n = c.u16()? as usize;
        let mut regions = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            regions.push((c.u32()?, c.u64()?, c.u32()?));
        }
        c.finish()?;
        Ok(RdmaAccept {
            endpoint,
            atomics,
            regions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_wr() -> impl Strategy<Value = WorkRequest<'static>> {
        let addr = (any::<u32>(), any::<u64>()).prop_map(|(k, o)| RemoteAddr::new(k, o));
        prop_oneof![
            (addr.clone(), any::<u32>()).prop_map(|(addr, len)| WorkRequest::Read {
                addr,
                len: len % 100_000
            }),
            (addr.clone(), proptest::collection::vec(any::<u8>(), 0..64)).prop_map(|(addr, d)| {
                WorkRequest::Write {
                    addr,
                    data: Cow::Owned(d),
                }
            }),
            (addr.clone(), any::<u64>(), any::<u64>()).prop_map(|(addr, compare, swap)| {
                WorkRequest::Cas {
                    addr,
                    compare,
                    swap,
                }
            }),
            (addr.clone(), any::<u64>()).prop_map(|(addr, add)| WorkRequest::Faa { addr, add }),
            (addr.clone(), any::<[u64; 4]>()).prop_map(|(addr, w)| WorkRequest::MaskedCas {
                addr,
                compare: w[0],
                compare_mask: w[1],
                swap: w[2],
                swap_mask: w[3]
            }),
            (addr, any::<u64>(), any::<u64>()).prop_map(|(addr, add, boundary)| {
                WorkRequest::MaskedFaa {
                    addr,
                    add,
                    boundary,
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn verbs_request_round_trips(seq: u64, sent_ns: u64, deadline_ms: u32, wrs in proptest::collection::vec(arb_wr(), 0..20)) {
            let mut body = Vec::new();
            let head = BatchHead { seq, sent_ns, deadline_ms };
            encode_verbs_request(&mut body, &head, &wrs);
            let (h, decoded) = decode_verbs_request(&body).unwrap();
            prop_assert_eq!(h, head);
            prop_assert_eq!(decoded, wrs);
        }

        /// The payloads left apart, put back where they belong, give the whole encoding.
        #[test]
        fn payloads_apart_splice_into_the_whole_request(seq: u64, wrs in proptest::collection::vec(arb_wr(), 0..20), apart_from in 0usize..80) {
            let head = BatchHead { seq, ..BatchHead::default() };
            let mut whole = Vec::new();
            encode_verbs_request(&mut whole, &head, &wrs);
            let mut out = Vec::new();
            let apart = encode_verbs_request_apart(&mut out, &head, &wrs, apart_from);
            let mut spliced = Vec::new();
            let mut at = 0;
            for (pos, data) in &apart {
                prop_assert!(data.len() >= apart_from);
                spliced.extend_from_slice(&out[at..*pos]);
                spliced.extend_from_slice(data);
                at = *pos;
            }
            spliced.extend_from_slice(&out[at..]);
            prop_assert_eq!(spliced, whole);
        }

        #[test]
        fn truncated_requests_are_errors(seq: u64, wrs in proptest::collection::vec(arb_wr(), 1..8), cut in 0usize..1000) {
            let mut body = Vec::new();
            encode_verbs_request(&mut body, &BatchHead { seq, ..BatchHead::default() }, &wrs);
            let cut = cut % body.len();
            prop_assert!(decode_verbs_request(&body[..cut]).is_err());
        }

        #[test]
        fn rdma_accept_round_trips_and_truncations_fail(qpn: u32, psn in 0u32..1 << 24, lid: u16, gid: [u8; 16], atomics in ".{0,40}", regions in proptest::collection::vec(any::<(u32, u64, u32)>(), 0..4), cut in 0usize..400) {
            let a = RdmaAccept { endpoint: RdmaEndpoint { qpn, psn, lid, gid }, atomics, regions };
            let body = a.encode();
            prop_assert_eq!(RdmaAccept::decode(&body).unwrap(), a);
            prop_assert!(RdmaAccept::decode(&body[..cut % body.len()]).is_err());
        }

        #[test]
        fn handshake_messages_round_trip(nonce: [u8; 32], proof: [u8; 32], name in ".{0,40}", id: u32, fence: u64) {
            let h = Hello { kind: ConnKind::Control, nonce, client_name: name.clone(), fence, sent_ns: fence ^ 1 };
            prop_assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
            let c = Challenge { nonce };
            prop_assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
            let w = Welcome { proof, node_name: name, node_id: id, regions: vec![RegionInfo { rkey: id, len: 4096, access: Access::ALL }] };
            prop_assert_eq!(Welcome::decode(&w.encode()).unwrap(), w);
        }
    }

    /// A frame replaces what `body` held (longer or shorter), and one cut short anywhere is an
    /// error naming the truncation, not a short body.
    #[test]
    fn frames_replace_the_body_and_truncated_ones_fail() {
        let frame = |len: usize| {
            let mut f = encode_header(FrameKind::VerbsResponse, len).to_vec();
            f.extend((0..len).map(|i| i as u8));
            f
        };
        let mut body = vec![0xee; 5000];
        for len in [0, 3, 4096, 70_000, 10] {
            let f = frame(len);
            assert_eq!(
                read_frame(&mut &f[..], &mut body).unwrap(),
                FrameKind::VerbsResponse
            );
            assert_eq!(body, f[HEADER_LEN..], "a {len}-byte frame");
        }
        let f = frame(4096);
        for cut in [1, HEADER_LEN, HEADER_LEN + 1, f.len() - 1] {
            let e = read_frame(&mut &f[..cut], &mut body).unwrap_err();
            assert!(e.to_string().contains("truncated"), "cut at {cut}: {e}");
        }
        assert!(matches!(
            read_frame(&mut &f[..0], &mut body),
            Err(WireError::Closed)
        ));
    }

    #[test]
    fn header_checks() {
        let h = encode_header(FrameKind::Hello, 10);
        assert_eq!(decode_header(&h).unwrap(), (FrameKind::Hello, 10));
        let mut bad = h;
        bad[0] = b'X';
        assert!(matches!(decode_header(&bad), Err(WireError::BadMagic(_))));
        let mut bad = h;
        bad[2] = 9;
        assert!(matches!(
            decode_header(&bad),
            Err(WireError::UnsupportedVersion { got: 9 })
        ));
        let mut bad = h;
        bad[3] = 200;
        assert!(matches!(
            decode_header(&bad),
            Err(WireError::UnknownKind(200))
        ));
        let big = encode_header(FrameKind::Hello, (MAX_FRAME_BODY + 1) as usize);
        assert!(matches!(
            decode_header(&big),
            Err(WireError::TooLarge { .. })
        ));
    }
}
