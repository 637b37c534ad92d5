//! Typed errors of the verbs layer.

use crate::wr::{Access, Opcode};

/// Why one work request, a batch or a connection failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    #[error("remote key {rkey:#x} does not name a region registered on this memory node")]
    BadKey { rkey: u32 },
    #[error("{op} of {len} bytes at offset {offset:#x} falls outside region {rkey:#x} of {region_len} bytes")]
    OutOfBounds {
        op: Opcode,
        rkey: u32,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("{op} is not permitted on region {rkey:#x} (registered with access {access})")]
    AccessDenied {
        op: Opcode,
        rkey: u32,
        access: Access,
    },
    #[error("atomic {op} at offset {offset:#x} is not 8-byte aligned")]
    Misaligned { op: Opcode, offset: u64 },
    #[error("not executed: an earlier work request in the same batch failed")]
    Flushed,
    #[error("batch too large: {what} is {got}, the limit is {limit}")]
    BatchTooLarge {
        what: &'static str,
        got: u64,
        limit: u64,
    },
    #[error("connection to {peer} lost: {reason}")]
    ConnectionLost { peer: String, reason: String },
    #[error("protocol error from {peer}: {reason}")]
    Protocol { peer: String, reason: String },
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },
    #[error("cannot connect to {peer}: {reason}")]
    Connect { peer: String, reason: String },
    /// The node fenced this client (its lease expired): nothing it sends is executed any more.
    #[error("{peer} fenced this client: {reason}")]
    Fenced { peer: String, reason: String },
    #[error("the simulated client of this queue pair was killed")]
    Killed,
}

impl VerbsError {
    /// Wire status code of a per-request error (0 is success).
    pub(crate) fn status_code(&self) -> u8 {
        match self {
            VerbsError::BadKey { .. } => 1,
            VerbsError::OutOfBounds { .. } => 2,
            VerbsError::AccessDenied { .. } => 3,
            VerbsError::Misaligned { .. } => 4,
            _ => 5, // Flushed, and anything that cannot be a per-request error
        }
    }

    /// The 64-bit detail carried on the wire beside the status code.
    pub(crate) fn status_detail(&self) -> u64 {
        match self {
            VerbsError::OutOfBounds { region_len, .. } => *region_len,
            VerbsError::AccessDenied { access, .. } => access.bits() as u64,
            _ => 0,
        }
    }

    /// Rebuilds a per-request error from its wire status, with the request's own context.
    pub(crate) fn from_status(
        code: u8,
        detail: u64,
        op: Opcode,
        rkey: u32,
        offset: u64,
        len: u64,
    ) -> Option<VerbsError> {
        Some(match code {
            1 => VerbsError::BadKey { rkey },
            2 => VerbsError::OutOfBounds {
                op,
                rkey,
                offset,
                len,
                region_len: detail,
            },
            3 => VerbsError::AccessDenied {
                op,
                rkey,
                access: Access::from_bits(detail as u8),
            },
            4 => VerbsError::Misaligned { op, offset },
            5 => VerbsError::Flushed,
            _ => return None,
        })
    }
}
