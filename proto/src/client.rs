//! The blocking control-RPC client of one memory node, used by mounts, the CLI, joining
//! nodes and the primary itself.

use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;

use rackfs_verbs::auth::{client_handshake, Accepted, Secret};
use rackfs_verbs::wire::{self, ConnKind, FrameKind};
use rackfs_verbs::{Access, RegionInfo, VerbsError};

use crate::control::{
    ClusterInfo, ControlRequest, ControlResponse, ErrorCode, NodeStats, Refusal, PROTOCOL_VERSION,
};
use crate::namespace::MetaRequest;

/// Why a control RPC failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RpcError {
    /// The node refused the request (out of memory, invalid, ...); `message` says why.
    #[error("{message}")]
    Refused { code: ErrorCode, message: String },
    #[error(transparent)]
    Connection(#[from] VerbsError),
    #[error(
        "{peer} speaks protocol version {theirs}, this side speaks {ours}: upgrade the older side"
    )]
    Version {
        peer: String,
        ours: u32,
        theirs: u32,
    },
    #[error("unexpected reply from {peer}: {what}")]
    Unexpected { peer: String, what: String },
}

impl RpcError {
    /// The errno a filesystem returns for this failure (EIO for a lost or confused node).
    pub fn errno(&self) -> i32 {
        match self {
            RpcError::Refused { code, .. } => code.errno(),
            RpcError::Version { .. } => libc::EPROTO,
            _ => libc::EIO,
        }
    }

    /// The refusal this error carries, or an `Unavailable` one naming what went wrong (for a
    /// node relaying another node's failure).
    pub fn into_refusal(self) -> Refusal {
        match self {
            RpcError::Refused { code, message } => Refusal { code, message },
            other => Refusal::new(ErrorCode::Unavailable, other.to_string()),
        }
    }
}

struct Stream {
    reader: BufReader<Box<dyn Read + Send>>,
    writer: BufWriter<Box<dyn Write + Send>>,
}

/// A blocking control-RPC client of one memory node.
pub struct ControlClient {
    peer: String,
    node_id: u32,
    node_name: String,
    regions: Vec<RegionInfo>,
    conn: Mutex<(Stream, u64)>,
}

impl ControlClient {
    /// Connects to `addr`: `host:port`, or `unix:PATH` for the node's Unix socket.
    pub fn connect(addr: &str, secret: &Secret, client_name: &str) -> Result<Self, RpcError> {
        match addr.strip_prefix("unix:") {
            Some(path) => Self::connect_unix(Path::new(path), secret, client_name),
            None => Self::connect_tcp(addr, secret, client_name),
        }
    }

    /// Connects over TCP (`host:port`).
    pub fn connect_tcp(addr: &str, secret: &Secret, client_name: &str) -> Result<Self, RpcError> {
        let mut s = rackfs_verbs::tcp::dial(addr)?;
        let acc = client_handshake(&mut s, ConnKind::Control, secret, client_name, addr)?;
        let r = s.try_clone().map_err(|e| VerbsError::Connect {
            peer: addr.into(),
            reason: e.to_string(),
        })?;
        Self::new(addr.into(), acc, Box::new(r), Box::new(s))
    }

    /// Connects over the node's Unix socket.
    pub fn connect_unix(path: &Path, secret: &Secret, client_name: &str) -> Result<Self, RpcError> {
        let peer = format!("unix:{}", path.display());
        let io = |e: std::io::Error| VerbsError::Connect {
            peer: peer.clone(),
            reason: e.to_string(),
        };
        let mut s = UnixStream::connect(path).map_err(io)?;
        let acc = client_handshake(&mut s, ConnKind::Control, secret, client_name, &peer)?;
        let r = s.try_clone().map_err(io)?;
        Self::new(peer, acc, Box::new(r), Box::new(s))
    }

    /// Wraps an authenticated stream and checks the node's protocol version.
    fn new(
        peer: String,
        acc: Accepted,
        r: Box<dyn Read + Send>,
        w: Box<dyn Write + Send>,
    ) -> Result<Self, RpcError> {
        let c = ControlClient {
            peer,
            node_id: acc.welcome.node_id,
            node_name: acc.node_name,
            regions: acc.welcome.regions,
            conn: Mutex::new((
                Stream {
                    reader: BufReader::new(r),
                    writer: BufWriter::new(w),
                },
                0,
            )),
        };
        c.hello(PROTOCOL_VERSION)?;
        Ok(c)
    }

    /// Tells the node which protocol version this side speaks (done by every connect); the
    /// node answers with its own, and serves nothing more on a connection whose versions differ.
    pub fn hello(&self, version: u32) -> Result<(), RpcError> {
        match self.call(&ControlRequest::Hello { version })? {
            ControlResponse::Hello { version: theirs } if theirs == version => Ok(()),
            ControlResponse::Hello { version: theirs } => Err(RpcError::Version {
                peer: self.peer.clone(),
                ours: version,
                theirs,
            }),
            other => Err(self.mismatch(other)),
        }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }
    pub fn node_id(&self) -> u32 {
        self.node_id
    }
    pub fn node_name(&self) -> &str {
        &self.node_name
    }
    /// The node's regions; the first is its data region.
    pub fn regions(&self) -> &[RegionInfo] {
        &self.regions
    }

    /// Sends one request and waits for its response; an error response becomes `Refused`.
    pub fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError> {
        let lost = |reason: String| {
            RpcError::Connection(VerbsError::ConnectionLost {
                peer: self.peer.clone(),
                reason,
            })
        };
        let mut guard = self.conn.lock().expect("control connection lock");
        let (stream, next_id) = &mut *guard;
        let id = *next_id;
        *next_id += 1;
        wire::write_frame(
            &mut stream.writer,
            FrameKind::ControlRequest,
            &req.encode(id),
        )
        .and_then(|_| stream.writer.flush())
        .map_err(|e| lost(e.to_string()))?;
        let mut body = Vec::new();
        let kind =
            wire::read_frame(&mut stream.reader, &mut body).map_err(|e| lost(e.to_string()))?;
        let unexpected = |what: String| RpcError::Unexpected {
            peer: self.peer.clone(),
            what,
        };
        if kind != FrameKind::ControlResponse {
            return Err(unexpected(format!("a {kind:?} frame")));
        }
        let (rid, resp) = ControlResponse::decode(&body).map_err(|e| unexpected(e.to_string()))?;
        if rid != id {
            return Err(unexpected(format!("response {rid} to request {id}")));
        }
        match resp {
            ControlResponse::Error { code, message } => Err(RpcError::Refused { code, message }),
            other => Ok(other),
        }
    }

    fn mismatch(&self, got: ControlResponse) -> RpcError {
        RpcError::Unexpected {
            peer: self.peer.clone(),
            what: format!("{got:?}"),
        }
    }

    pub fn stats(&self) -> Result<NodeStats, RpcError> {
        match self.call(&ControlRequest::Stats)? {
            ControlResponse::Stats(s) => Ok(*s),
            other => Err(self.mismatch(other)),
        }
    }

    /// Allocates an extent; returns its region and offset.
    pub fn alloc(&self, len: u64, align: u64) -> Result<(RegionInfo, u64), RpcError> {
        self.alloc_tagged(len, align, None)
    }

    /// Allocates an extent, optionally tagged as a file stripe (see [`ControlRequest::Alloc`]).
    pub fn alloc_tagged(
        &self,
        len: u64,
        align: u64,
        tag: Option<u64>,
    ) -> Result<(RegionInfo, u64), RpcError> {
        match self.call(&ControlRequest::Alloc { len, align, tag })? {
            ControlResponse::Allocated {
                rkey,
                region_len,
                offset,
                ..
            } => Ok((
                RegionInfo {
                    rkey,
                    len: region_len,
                    access: Access::ALL,
                },
                offset,
            )),
            other => Err(self.mismatch(other)),
        }
    }

    /// Frees the extent at `offset`; returns how many bytes come back.
    pub fn free(&self, offset: u64) -> Result<u64, RpcError> {
        match self.call(&ControlRequest::Free { offset })? {
            ControlResponse::Freed { len } => Ok(len),
            other => Err(self.mismatch(other)),
        }
    }

    pub fn cluster(&self) -> Result<ClusterInfo, RpcError> {
        match self.call(&ControlRequest::Cluster)? {
            ControlResponse::Cluster(c) => Ok(c),
            other => Err(self.mismatch(other)),
        }
    }

    /// A namespace operation on the primary.
    pub fn meta(&self, req: MetaRequest) -> Result<ControlResponse, RpcError> {
        self.call(&ControlRequest::Meta(req))
    }
}
