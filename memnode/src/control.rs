//! The control RPC: the only path on which a memory node's CPU does work for a client.
//!
//! Requests and responses travel in `ControlRequest`/`ControlResponse` frames of the verbs wire
//! protocol ([`rackfs_verbs::wire`]) on an authenticated control connection, one response per
//! request, in order. Body: `id u64, op u8` and the op's fields; decoding is strict (every length
//! checked, no trailing bytes) so a malformed body closes the connection instead of panicking.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;

use rackfs_verbs::auth::{client_handshake, Secret};
use rackfs_verbs::wire::{self, put_str, ConnKind, Cursor, FrameKind, WireError};
use rackfs_verbs::{RegionInfo, VerbTotals, VerbsError};

/// Kinds of control RPC, for counters.
pub const RPC_KINDS: [&str; 4] = ["ping", "stats", "alloc", "free"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlRequest {
    Ping,
    Stats,
    /// Allocate an extent of the data region.
    Alloc {
        len: u64,
        align: u64,
    },
    /// Free the extent that starts at `offset`.
    Free {
        offset: u64,
    },
}

impl ControlRequest {
    pub fn kind_index(&self) -> usize {
        match self {
            ControlRequest::Ping => 0,
            ControlRequest::Stats => 1,
            ControlRequest::Alloc { .. } => 2,
            ControlRequest::Free { .. } => 3,
        }
    }
}

/// Error classes a node reports; each response error also carries a full message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorCode {
    OutOfMemory = 1,
    Invalid = 2,
    NotFound = 3,
    Internal = 4,
}

impl ErrorCode {
    fn from_u8(v: u8) -> Option<ErrorCode> {
        [
            ErrorCode::OutOfMemory,
            ErrorCode::Invalid,
            ErrorCode::NotFound,
            ErrorCode::Internal,
        ]
        .into_iter()
        .find(|c| *c as u8 == v)
    }
}

/// Everything a node reports about itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStats {
    pub node_id: u32,
    pub name: String,
    pub uptime_ms: u64,
    pub capacity: u64,
    pub used: u64,
    pub free: u64,
    pub largest_free: u64,
    pub extents: u64,
    /// Verbs served by NIC threads and executed by shm clients, by opcode.
    pub verbs: VerbTotals,
    /// Control RPCs served, by kind ([`RPC_KINDS`]).
    pub rpcs: [u64; RPC_KINDS.len()],
    /// Open connections by kind: verbs, control, shm.
    pub open: [u64; 3],
    pub connections_total: u64,
    pub auth_failures: u64,
    pub protocol_errors: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlResponse {
    Pong,
    Stats(Box<NodeStats>),
    Allocated {
        region: RegionInfo,
        offset: u64,
        len: u64,
    },
    Freed {
        len: u64,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
}

fn put_u64s(out: &mut Vec<u8>, words: &[u64]) {
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

impl ControlRequest {
    pub fn encode(&self, id: u64) -> Vec<u8> {
        let mut b = id.to_le_bytes().to_vec();
        match self {
            ControlRequest::Ping => b.push(0),
            ControlRequest::Stats => b.push(1),
            ControlRequest::Alloc { len, align } => {
                b.push(2);
                put_u64s(&mut b, &[*len, *align]);
            }
            ControlRequest::Free { offset } => {
                b.push(3);
                put_u64s(&mut b, &[*offset]);
            }
        }
        b
    }

    pub fn decode(body: &[u8]) -> Result<(u64, ControlRequest), WireError> {
        let mut c = Cursor::new(body, "control request");
        let id = c.u64()?;
        let op = c.u8()?;
        let req = match op {
            0 => ControlRequest::Ping,
            1 => ControlRequest::Stats,
            2 => ControlRequest::Alloc {
                len: c.u64()?,
                align: c.u64()?,
            },
            3 => ControlRequest::Free { offset: c.u64()? },
            other => {
                return Err(WireError::malformed(
                    "control request",
                    format!("unknown op {other}"),
                ))
            }
        };
        c.finish()?;
        Ok((id, req))
    }
}

impl ControlResponse {
    pub fn encode(&self, id: u64) -> Vec<u8> {
        let mut b = id.to_le_bytes().to_vec();
        match self {
            ControlResponse::Pong => b.push(0),
            ControlResponse::Stats(s) => {
                b.push(1);
                b.extend_from_slice(&s.node_id.to_le_bytes());
                put_str(&mut b, &s.name);
                put_u64s(
                    &mut b,
                    &[
                        s.uptime_ms,
                        s.capacity,
                        s.used,
                        s.free,
                        s.largest_free,
                        s.extents,
                    ],
                );
                put_u64s(&mut b, &s.verbs.ops);
                put_u64s(&mut b, &s.verbs.bytes);
                put_u64s(&mut b, &[s.verbs.errors, s.verbs.batches]);
                put_u64s(&mut b, &s.rpcs);
                put_u64s(&mut b, &s.open);
                put_u64s(
                    &mut b,
                    &[s.connections_total, s.auth_failures, s.protocol_errors],
                );
            }
            ControlResponse::Allocated {
                region,
                offset,
                len,
            } => {
                b.push(2);
                b.extend_from_slice(&region.rkey.to_le_bytes());
                put_u64s(&mut b, &[region.len]);
                b.push(region.access.bits());
                put_u64s(&mut b, &[*offset, *len]);
            }
            ControlResponse::Freed { len } => {
                b.push(3);
                put_u64s(&mut b, &[*len]);
            }
            ControlResponse::Error { code, message } => {
                b.push(255);
                b.push(*code as u8);
                put_str(&mut b, message);
            }
        }
        b
    }

    pub fn decode(body: &[u8]) -> Result<(u64, ControlResponse), WireError> {
        let mut c = Cursor::new(body, "control response");
        let id = c.u64()?;
        let op = c.u8()?;
        fn arr<const N: usize>(c: &mut Cursor<'_>) -> Result<[u64; N], WireError> {
            let mut a = [0u64; N];
            for x in a.iter_mut() {
                *x = c.u64()?;
            }
            Ok(a)
        }
        let resp = match op {
            0 => ControlResponse::Pong,
            1 => {
                let node_id = c.u32()?;
                let name = c.str()?;
                let [uptime_ms, capacity, used, free, largest_free, extents] = arr::<6>(&mut c)?;
                let ops = arr::<6>(&mut c)?;
                let bytes = arr::<6>(&mut c)?;
                let [errors, batches] = arr::<2>(&mut c)?;
                let rpcs = arr::<{ RPC_KINDS.len() }>(&mut c)?;
                let open = arr::<3>(&mut c)?;
                let [connections_total, auth_failures, protocol_errors] = arr::<3>(&mut c)?;
                ControlResponse::Stats(Box::new(NodeStats {
                    node_id,
                    name,
                    uptime_ms,
                    capacity,
                    used,
                    free,
                    largest_free,
                    extents,
                    verbs: VerbTotals {
                        ops,
                        bytes,
                        errors,
                        batches,
                    },
                    rpcs,
                    open,
                    connections_total,
                    auth_failures,
                    protocol_errors,
                }))
            }
            2 => ControlResponse::Allocated {
                region: RegionInfo {
                    rkey: c.u32()?,
                    len: c.u64()?,
                    access: rackfs_verbs::Access::from_bits(c.u8()?),
                },
                offset: c.u64()?,
                len: c.u64()?,
            },
            3 => ControlResponse::Freed { len: c.u64()? },
            255 => {
                let code_byte = c.u8()?;
                let code = ErrorCode::from_u8(code_byte).ok_or_else(|| {
                    WireError::malformed(
                        "control response",
                        format!("unknown error code {code_byte}"),
                    )
                })?;
                ControlResponse::Error {
                    code,
                    message: c.str()?,
                }
            }
            other => {
                return Err(WireError::malformed(
                    "control response",
                    format!("unknown op {other}"),
                ))
            }
        };
        c.finish()?;
        Ok((id, resp))
    }
}

/// Why a control RPC failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RpcError {
    /// The node refused the request (out of memory, invalid, ...); `message` says why.
    #[error("{message}")]
    Refused { code: ErrorCode, message: String },
    #[error(transparent)]
    Connection(#[from] VerbsError),
    #[error("unexpected reply from {peer}: {what}")]
    Unexpected { peer: String, what: String },
}

enum Stream {
    Tcp(BufReader<TcpStream>, BufWriter<TcpStream>),
    Unix(BufReader<UnixStream>, BufWriter<UnixStream>),
}

impl Stream {
    fn parts(&mut self) -> (&mut dyn Read, &mut dyn Write) {
        match self {
            Stream::Tcp(r, w) => (r, w),
            Stream::Unix(r, w) => (r, w),
        }
    }
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
    /// Connects over TCP (`host:port`).
    pub fn connect_tcp(addr: &str, secret: &Secret, client_name: &str) -> Result<Self, VerbsError> {
        let mut s = rackfs_verbs::tcp::dial(addr)?;
        let acc = client_handshake(&mut s, ConnKind::Control, secret, client_name, addr)?;
        let io = |e: std::io::Error| VerbsError::Connect {
            peer: addr.into(),
            reason: e.to_string(),
        };
        let stream = Stream::Tcp(
            BufReader::new(s.try_clone().map_err(io)?),
            BufWriter::new(s),
        );
        Ok(Self::new(addr.into(), acc, stream))
    }

    /// Connects over the node's Unix socket.
    pub fn connect_unix(
        path: &Path,
        secret: &Secret,
        client_name: &str,
    ) -> Result<Self, VerbsError> {
        let peer = format!("unix:{}", path.display());
        let io = |e: std::io::Error| VerbsError::Connect {
            peer: peer.clone(),
            reason: e.to_string(),
        };
        let mut s = UnixStream::connect(path).map_err(io)?;
        let acc = client_handshake(&mut s, ConnKind::Control, secret, client_name, &peer)?;
        let stream = Stream::Unix(
            BufReader::new(s.try_clone().map_err(io)?),
            BufWriter::new(s),
        );
        Ok(Self::new(peer, acc, stream))
    }

    fn new(peer: String, acc: rackfs_verbs::auth::Accepted, stream: Stream) -> Self {
        ControlClient {
            peer,
            node_id: acc.welcome.node_id,
            node_name: acc.node_name,
            regions: acc.welcome.regions,
            conn: Mutex::new((stream, 0)),
        }
    }

    pub fn node_id(&self) -> u32 {
        self.node_id
    }
    pub fn node_name(&self) -> &str {
        &self.node_name
    }
    pub fn regions(&self) -> &[RegionInfo] {
        &self.regions
    }

    /// Sends one request and waits for its response.
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
        let (r, w) = stream.parts();
        wire::write_frame(w, FrameKind::ControlRequest, &req.encode(id))
            .and_then(|_| w.flush())
            .map_err(|e| lost(e.to_string()))?;
        let mut body = Vec::new();
        let kind = wire::read_frame(r, &mut body).map_err(|e| lost(e.to_string()))?;
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

    pub fn stats(&self) -> Result<NodeStats, RpcError> {
        match self.call(&ControlRequest::Stats)? {
            ControlResponse::Stats(s) => Ok(*s),
            other => Err(self.mismatch(other)),
        }
    }

    /// Allocates an extent; returns its region and offset.
    pub fn alloc(&self, len: u64, align: u64) -> Result<(RegionInfo, u64), RpcError> {
        match self.call(&ControlRequest::Alloc { len, align })? {
            ControlResponse::Allocated { region, offset, .. } => Ok((region, offset)),
            other => Err(self.mismatch(other)),
        }
    }

    /// Frees the extent at `offset`; returns how many bytes came back.
    pub fn free(&self, offset: u64) -> Result<u64, RpcError> {
        match self.call(&ControlRequest::Free { offset })? {
            ControlResponse::Freed { len } => Ok(len),
            other => Err(self.mismatch(other)),
        }
    }

    fn mismatch(&self, got: ControlResponse) -> RpcError {
        RpcError::Unexpected {
            peer: self.peer.clone(),
            what: format!("{got:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn requests_round_trip(id: u64, len: u64, align: u64, which in 0u8..4) {
            let req = match which {
                0 => ControlRequest::Ping,
                1 => ControlRequest::Stats,
                2 => ControlRequest::Alloc { len, align },
                _ => ControlRequest::Free { offset: len },
            };
            prop_assert_eq!(ControlRequest::decode(&req.encode(id)).unwrap(), (id, req));
        }

        #[test]
        fn stats_round_trip(id: u64, words in proptest::collection::vec(any::<u64>(), 40), name in ".{0,30}") {
            let s = NodeStats {
                node_id: words[0] as u32, name, uptime_ms: words[1], capacity: words[2], used: words[3],
                free: words[4], largest_free: words[5], extents: words[6],
                verbs: VerbTotals { ops: words[7..13].try_into().unwrap(), bytes: words[13..19].try_into().unwrap(), errors: words[19], batches: words[20] },
                rpcs: words[21..25].try_into().unwrap(), open: words[25..28].try_into().unwrap(),
                connections_total: words[28], auth_failures: words[29], protocol_errors: words[30],
            };
            let r = ControlResponse::Stats(Box::new(s));
            prop_assert_eq!(ControlResponse::decode(&r.encode(id)).unwrap(), (id, r));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ControlRequest::decode(&bytes);
            let _ = ControlResponse::decode(&bytes);
        }
    }
}
