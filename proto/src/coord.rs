//! The coordinator calls a data node makes to the embedded coordinator, which the primary holds
//! when the cluster runs without etcd (`rackfs_coord::Local`): the same operations as
//! `rackfs_coord::Coordinator`, carried in [`crate::ControlRequest::Coord`].

use serde::{Deserialize, Serialize};

/// One coordinator operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CoordCall {
    Grant {
        ttl_ms: u64,
    },
    KeepAlive {
        lease: i64,
    },
    Revoke {
        lease: i64,
    },
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Create {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Get {
        key: String,
    },
    List {
        prefix: String,
    },
    Delete {
        key: String,
    },
    /// The key's value and the revision it was created at.
    Created {
        key: String,
    },
    /// `write` only while `guard` (a key and the lease it must be under) holds.
    WriteIf {
        guard: (String, i64),
        write: CoordWrite,
    },
    /// Whether `guard` holds.
    Holds {
        guard: (String, i64),
    },
}

/// A guarded write ([`CoordCall::WriteIf`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CoordWrite {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Delete {
        key: String,
    },
}

/// Its answer (a lapsed lease is refused with `ErrorCode::Fenced`, a guard that does not hold
/// with `ErrorCode::NotPrimary`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CoordAnswer {
    Granted {
        lease: i64,
        ttl_ms: u64,
    },
    Ttl {
        ms: u64,
    },
    Done,
    /// `Create`: the revision it was created at, else the value that holds the key.
    Created(Result<u64, Vec<u8>>),
    Value(Option<Vec<u8>>),
    /// `Created`: the revision the key was created at and its value.
    Versioned(Option<(u64, Vec<u8>)>),
    Holds(bool),
    Keys(Vec<(String, Vec<u8>)>),
}
