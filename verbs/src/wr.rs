//! Work requests, batches and their completions.

use std::borrow::Cow;
use std::fmt;

use crate::VerbsError;

/// At most this many work requests in one batch (one doorbell, one round trip).
pub const MAX_BATCH_REQUESTS: usize = 4096;
/// At most this many payload bytes (written plus read) in one batch.
pub const MAX_BATCH_BYTES: u64 = 16 << 20;

/// A remote address: a registered region's key and a byte offset inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteAddr {
    pub rkey: u32,
    pub offset: u64,
}

impl RemoteAddr {
    pub const fn new(rkey: u32, offset: u64) -> Self {
        RemoteAddr { rkey, offset }
    }

    /// The address `bytes` further into the same region.
    pub const fn add(self, bytes: u64) -> Self {
        RemoteAddr {
            rkey: self.rkey,
            offset: self.offset + bytes,
        }
    }
}

/// Access rights a region is registered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Access(u8);

impl Access {
    pub const READ: Access = Access(1);
    pub const WRITE: Access = Access(2);
    pub const ATOMIC: Access = Access(4);
    pub const ALL: Access = Access(7);

    pub const fn bits(self) -> u8 {
        self.0
    }
    pub const fn from_bits(bits: u8) -> Access {
        Access(bits & 7)
    }
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Access::READ, "read"),
            (Access::WRITE, "write"),
            (Access::ATOMIC, "atomic"),
        ];
        let parts: Vec<&str> = names
            .iter()
            .filter(|(a, _)| self.contains(*a))
            .map(|(_, n)| *n)
            .collect();
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join("+"))
        }
    }
}

/// The kind of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Read = 1,
    Write = 2,
    Cas = 3,
    Faa = 4,
    MaskedCas = 5,
    MaskedFaa = 6,
}

impl Opcode {
    pub const ALL: [Opcode; 6] = [
        Opcode::Read,
        Opcode::Write,
        Opcode::Cas,
        Opcode::Faa,
        Opcode::MaskedCas,
        Opcode::MaskedFaa,
    ];

    pub fn from_u8(v: u8) -> Option<Opcode> {
        Opcode::ALL.get((v as usize).wrapping_sub(1)).copied()
    }

    /// Dense index 0..6, for counters.
    pub fn index(self) -> usize {
        self as usize - 1
    }

    /// The access right a request of this kind needs.
    pub fn access(self) -> Access {
        match self {
            Opcode::Read => Access::READ,
            Opcode::Write => Access::WRITE,
            _ => Access::ATOMIC,
        }
    }

    pub fn is_atomic(self) -> bool {
        self.access() == Access::ATOMIC
    }

    pub fn name(self) -> &'static str {
        match self {
            Opcode::Read => "READ",
            Opcode::Write => "WRITE",
            Opcode::Cas => "CAS",
            Opcode::Faa => "FAA",
            Opcode::MaskedCas => "MASKED_CAS",
            Opcode::MaskedFaa => "MASKED_FAA",
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One one-sided operation on remote memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkRequest<'a> {
    Read {
        addr: RemoteAddr,
        len: u32,
    },
    Write {
        addr: RemoteAddr,
        data: Cow<'a, [u8]>,
    },
    Cas {
        addr: RemoteAddr,
        compare: u64,
        swap: u64,
    },
    Faa {
        addr: RemoteAddr,
        add: u64,
    },
    MaskedCas {
        addr: RemoteAddr,
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    },
    MaskedFaa {
        addr: RemoteAddr,
        add: u64,
        boundary: u64,
    },
}

impl WorkRequest<'_> {
    pub fn opcode(&self) -> Opcode {
        match self {
            WorkRequest::Read { .. } => Opcode::Read,
            WorkRequest::Write { .. } => Opcode::Write,
            WorkRequest::Cas { .. } => Opcode::Cas,
            WorkRequest::Faa { .. } => Opcode::Faa,
            WorkRequest::MaskedCas { .. } => Opcode::MaskedCas,
            WorkRequest::MaskedFaa { .. } => Opcode::MaskedFaa,
        }
    }

    pub fn addr(&self) -> RemoteAddr {
        match self {
            WorkRequest::Read { addr, .. }
            | WorkRequest::Write { addr, .. }
            | WorkRequest::Cas { addr, .. }
            | WorkRequest::Faa { addr, .. }
            | WorkRequest::MaskedCas { addr, .. }
            | WorkRequest::MaskedFaa { addr, .. } => *addr,
        }
    }

    /// Bytes of remote memory the request touches.
    pub fn len(&self) -> u64 {
        match self {
            WorkRequest::Read { len, .. } => *len as u64,
            WorkRequest::Write { data, .. } => data.len() as u64,
            _ => 8,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy that owns its payload (for transports that execute after `post` returns).
    pub fn into_owned(self) -> WorkRequest<'static> {
        match self {
            WorkRequest::Write { addr, data } => WorkRequest::Write {
                addr,
                data: Cow::Owned(data.into_owned()),
            },
            WorkRequest::Read { addr, len } => WorkRequest::Read { addr, len },
            WorkRequest::Cas {
                addr,
                compare,
                swap,
            } => WorkRequest::Cas {
                addr,
                compare,
                swap,
            },
            WorkRequest::Faa { addr, add } => WorkRequest::Faa { addr, add },
            WorkRequest::MaskedCas {
                addr,
                compare,
                compare_mask,
                swap,
                swap_mask,
            } => WorkRequest::MaskedCas {
                addr,
                compare,
                compare_mask,
                swap,
                swap_mask,
            },
            WorkRequest::MaskedFaa {
                addr,
                add,
                boundary,
            } => WorkRequest::MaskedFaa {
                addr,
                add,
                boundary,
            },
        }
    }
}

/// Names one request of a batch, to find its completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrId(pub usize);

/// Work requests posted together: executed in order, completed with one round trip.
///
/// Write payloads may be borrowed: every transport either consumes them during `post` or copies
/// them, so the batch's lifetime ends when `post` returns.
#[derive(Clone, Debug, Default)]
pub struct Batch<'a> {
    pub(crate) requests: Vec<WorkRequest<'a>>,
    pub(crate) read_bytes: u64,
    pub(crate) payload_bytes: u64,
}

impl<'a> Batch<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(n: usize) -> Self {
        Batch {
            requests: Vec::with_capacity(n),
            ..Default::default()
        }
    }

    pub fn push(&mut self, wr: WorkRequest<'a>) -> WrId {
        match &wr {
            WorkRequest::Read { len, .. } => self.read_bytes += *len as u64,
            WorkRequest::Write { data, .. } => self.payload_bytes += data.len() as u64,
            _ => {}
        }
        self.requests.push(wr);
        WrId(self.requests.len() - 1)
    }

    pub fn read(&mut self, addr: RemoteAddr, len: u32) -> WrId {
        self.push(WorkRequest::Read { addr, len })
    }

    pub fn write(&mut self, addr: RemoteAddr, data: &'a [u8]) -> WrId {
        self.push(WorkRequest::Write {
            addr,
            data: Cow::Borrowed(data),
        })
    }

    pub fn write_owned(&mut self, addr: RemoteAddr, data: Vec<u8>) -> WrId {
        self.push(WorkRequest::Write {
            addr,
            data: Cow::Owned(data),
        })
    }

    /// Writes one little-endian 64-bit word.
    pub fn write_u64(&mut self, addr: RemoteAddr, value: u64) -> WrId {
        self.write_owned(addr, value.to_le_bytes().to_vec())
    }

    pub fn cas(&mut self, addr: RemoteAddr, compare: u64, swap: u64) -> WrId {
        self.push(WorkRequest::Cas {
            addr,
            compare,
            swap,
        })
    }

    pub fn faa(&mut self, addr: RemoteAddr, add: u64) -> WrId {
        self.push(WorkRequest::Faa { addr, add })
    }

    pub fn masked_cas(
        &mut self,
        addr: RemoteAddr,
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> WrId {
        self.push(WorkRequest::MaskedCas {
            addr,
            compare,
            compare_mask,
            swap,
            swap_mask,
        })
    }

    pub fn masked_faa(&mut self, addr: RemoteAddr, add: u64, boundary: u64) -> WrId {
        self.push(WorkRequest::MaskedFaa {
            addr,
            add,
            boundary,
        })
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    pub fn requests(&self) -> &[WorkRequest<'a>] {
        &self.requests
    }

    /// Bytes the batch's READs will return.
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes
    }

    /// Checks the batch against the per-batch limits every transport shares.
    pub fn check_limits(&self) -> Result<(), VerbsError> {
        if self.requests.len() > MAX_BATCH_REQUESTS {
            return Err(VerbsError::BatchTooLarge {
                what: "the number of work requests",
                got: self.requests.len() as u64,
                limit: MAX_BATCH_REQUESTS as u64,
            });
        }
        let bytes = self.read_bytes + self.payload_bytes;
        if bytes > MAX_BATCH_BYTES {
            return Err(VerbsError::BatchTooLarge {
                what: "the payload (bytes read plus written)",
                got: bytes,
                limit: MAX_BATCH_BYTES,
            });
        }
        Ok(())
    }
}

/// What one work request produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// READ data: a range of [`Completions::data`].
    Data {
        start: usize,
        len: usize,
    },
    /// The old value returned by an atomic.
    Value(u64),
    Written,
    Failed(VerbsError),
}

/// The completions of one batch, one per request, in posting order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Completions {
    pub(crate) outcomes: Vec<Outcome>,
    pub(crate) data: Vec<u8>,
}

impl Completions {
    pub(crate) fn with_capacity(requests: usize, read_bytes: usize) -> Self {
        Completions {
            outcomes: Vec::with_capacity(requests),
            data: Vec::with_capacity(read_bytes),
        }
    }

    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// Whether request `id` succeeded.
    pub fn status(&self, id: WrId) -> Result<(), VerbsError> {
        match self.outcomes.get(id.0) {
            Some(Outcome::Failed(e)) => Err(e.clone()),
            Some(_) => Ok(()),
            None => Err(VerbsError::Flushed),
        }
    }

    /// The old value an atomic request read.
    pub fn value(&self, id: WrId) -> Result<u64, VerbsError> {
        match self.outcomes.get(id.0) {
            Some(Outcome::Value(v)) => Ok(*v),
            Some(Outcome::Failed(e)) => Err(e.clone()),
            _ => Err(VerbsError::Flushed),
        }
    }

    /// The bytes a READ returned.
    pub fn data(&self, id: WrId) -> Result<&[u8], VerbsError> {
        match self.outcomes.get(id.0) {
            Some(Outcome::Data { start, len }) => Ok(&self.data[*start..*start + *len]),
            Some(Outcome::Failed(e)) => Err(e.clone()),
            _ => Err(VerbsError::Flushed),
        }
    }

    /// The first failure in the batch, if any.
    pub fn check(&self) -> Result<(), VerbsError> {
        match self.outcomes.iter().find_map(|o| match o {
            Outcome::Failed(e) => Some(e.clone()),
            _ => None,
        }) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(crate) fn push(&mut self, outcome: Outcome) {
        self.outcomes.push(outcome);
    }
}
