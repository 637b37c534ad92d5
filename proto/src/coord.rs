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
}

/// Its answer (a lapsed lease is refused with `ErrorCode::Fenced`).
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
    /// `Create`: `None` when created, else the value that holds the key.
    Created(Option<Vec<u8>>),
    Value(Option<Vec<u8>>),
    Keys(Vec<(String, Vec<u8>)>),
}
