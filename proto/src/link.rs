//! Control connections as the client core (`rackfs_fs`) and the memory node's logic
//! (`rackfs_memnode`) use them: a [`ControlLink`] carries one connection's requests and
//! answers, a [`Dial`] opens them. Neither names a socket: a mount or a memory node dials over
//! TCP or a node's Unix socket ([`NetDial`], with [`ControlClient`]); a test or a simulation
//! dials a [`Loopback`], which hands each request to a server in the same process.
//!
//! Why here: the links speak only this crate's control types and its [`ControlClient`], so
//! they need nothing this crate lacks, and both sides of the contract (mounts and memory nodes)
//! already depend on it; a crate of its own would add a name and nothing else. `rackfs_fs`
//! re-exports this module as `rackfs_fs::link`.
//!
//! Invariants every implementation keeps, as the client core and the memory node rely on them:
//! * a connection is a *session* on its node: `ControlRequest::Session` answers the same id
//!   for the connection's whole life, and the node may end the session when the connection
//!   goes;
//! * a refusal comes back as [`RpcError::Refused`] (never as `ControlResponse::Error`);
//! * a node gone or not answering is [`RpcError::Connection`] or [`RpcError::Timeout`], which
//!   the client core takes as "the primary may have died" (see `rackfs_fs`'s
//!   `Cluster::failover`) and a primary as "this data node may be down" (`rackfs_memnode`'s
//!   `Node::with_peer`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rackfs_verbs::{Access, RegionInfo, Secret, VerbsError};

use crate::control::{ClusterInfo, ControlRequest, ControlResponse, ExtentAt, NodeStats, Resolved};
use crate::namespace::MetaRequest;
use crate::{ControlClient, RpcError};

/// One control connection to a node.
pub trait ControlLink: Send + Sync {
    /// Sends one request and waits for its answer (at most the deadline).
    fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError>;

    /// [`ControlLink::call`], calling `sent` once the request is on its way, before its answer
    /// comes: a caller that orders requests on the connection lets the next one go then (the
    /// node takes a connection's requests in the order they were sent). Here, once answered.
    fn call_sent(
        &self,
        req: &ControlRequest,
        sent: &mut dyn FnMut(),
    ) -> Result<ControlResponse, RpcError> {
        let r = self.call(req);
        sent();
        r
    }

    /// How long each call may take from now on.
    fn set_deadline(&self, d: Duration);

    /// The address this connection was opened to (for messages).
    fn peer(&self) -> &str;

    /// The node's id.
    fn node_id(&self) -> u32;

    /// The node's name (for messages).
    fn node_name(&self) -> &str;

    /// A namespace operation on the primary.
    fn meta(&self, req: MetaRequest) -> Result<ControlResponse, RpcError> {
        self.call(&ControlRequest::Meta(req))
    }

    /// The cluster as the node knows it.
    fn cluster(&self) -> Result<ClusterInfo, RpcError> {
        match self.call(&ControlRequest::Cluster)? {
            ControlResponse::Cluster(c) => Ok(*c),
            other => Err(unexpected(self.peer(), other)),
        }
    }

    /// The node's statistics (its memory among them).
    fn stats(&self) -> Result<NodeStats, RpcError> {
        match self.call(&ControlRequest::Stats)? {
            ControlResponse::Stats(s) => Ok(*s),
            other => Err(unexpected(self.peer(), other)),
        }
    }

    /// Allocates an extent, optionally tagged as a file stripe (see [`ControlRequest::Alloc`]);
    /// returns its region and offset.
    fn alloc_tagged(
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
            other => Err(unexpected(self.peer(), other)),
        }
    }

    /// Moves the file stripe extent at `offset` into a new one (see [`ControlRequest::Resize`]);
    /// returns the new extent's offset.
    fn resize(&self, offset: u64, len: u64, tag: u64, expect: u64) -> Result<u64, RpcError> {
        let req = ControlRequest::Resize {
            offset,
            len,
            tag,
            expect,
        };
        match self.call(&req)? {
            ControlResponse::Allocated { offset, .. } => Ok(offset),
            other => Err(unexpected(self.peer(), other)),
        }
    }

    /// What the node holds now where stripe extents (base offset, tag) were (see
    /// [`ControlRequest::Resolve`]).
    fn resolve(&self, extents: Vec<(u64, u64)>) -> Result<Resolved, RpcError> {
        match self.call(&ControlRequest::Resolve { extents })? {
            ControlResponse::Resolved(r) => Ok(r),
            other => Err(unexpected(self.peer(), other)),
        }
    }

    /// [`ControlRequest::AllocMany`]: the base offsets of the stripe extents allocated, one
    /// per tag from the first, as many as fit.
    fn alloc_many(&self, len: u64, tags: Vec<u64>) -> Result<Vec<u64>, RpcError> {
        match self.call(&ControlRequest::AllocMany { len, tags })? {
            ControlResponse::AllocatedMany { offsets } => Ok(offsets),
            other => Err(unexpected(self.peer(), other)),
        }
    }

    /// [`ControlRequest::FreeMany`]: the extents (base offset, why) the node did not free.
    fn free_many(&self, extents: Vec<ExtentAt>) -> Result<Vec<(u64, String)>, RpcError> {
        match self.call(&ControlRequest::FreeMany { extents })? {
            ControlResponse::FreedMany { refused } => Ok(refused),
            other => Err(unexpected(self.peer(), other)),
        }
    }

    /// Frees the extent at `offset` (with `tag`: only the stripe extent with that owner tag);
    /// returns how many bytes come back.
    fn free(&self, offset: u64, tag: Option<u64>) -> Result<u64, RpcError> {
        match self.call(&ControlRequest::Free { offset, tag })? {
            ControlResponse::Freed { len } => Ok(len),
            other => Err(unexpected(self.peer(), other)),
        }
    }
}

/// An answer that does not fit the request, from `peer`.
fn unexpected(peer: &str, got: ControlResponse) -> RpcError {
    RpcError::Unexpected {
        peer: peer.into(),
        what: format!("{got:?}"),
    }
}

impl ControlLink for ControlClient {
    fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError> {
        ControlClient::call(self, req)
    }
    fn call_sent(
        &self,
        req: &ControlRequest,
        sent: &mut dyn FnMut(),
    ) -> Result<ControlResponse, RpcError> {
        ControlClient::call_sent(self, req, sent)
    }
    fn set_deadline(&self, d: Duration) {
        ControlClient::set_deadline(self, d)
    }
    fn peer(&self) -> &str {
        ControlClient::peer(self)
    }
    fn node_id(&self) -> u32 {
        ControlClient::node_id(self)
    }
    fn node_name(&self) -> &str {
        ControlClient::node_name(self)
    }
}

/// Opens control connections.
pub trait Dial: Send + Sync {
    /// A new connection (a new session) to the node at `addr`, authenticated with `secret`,
    /// as `client_name`.
    fn connect(
        &self,
        addr: &str,
        secret: &Secret,
        client_name: &str,
    ) -> Result<Arc<dyn ControlLink>, RpcError>;
}

/// Dials the network: `host:port` over TCP, `unix:PATH` over the node's Unix socket. Its
/// connections poll for answers for `poll` before they sleep ([`rackfs_verbs::poll`]).
#[derive(Debug, Clone, Copy)]
pub struct NetDial {
    pub poll: std::time::Duration,
}

impl Default for NetDial {
    fn default() -> NetDial {
        NetDial {
            poll: rackfs_verbs::poll::CONTROL_POLL,
        }
    }
}

impl Dial for NetDial {
    fn connect(
        &self,
        addr: &str,
        secret: &Secret,
        client_name: &str,
    ) -> Result<Arc<dyn ControlLink>, RpcError> {
        let c = ControlClient::connect(addr, secret, client_name)?;
        c.set_poll(self.poll);
        Ok(Arc::new(c))
    }
}

/// What a [`Loopback`] node does with a request of session `session` (neither `Hello` nor
/// `Session`, which the connection answers itself). A `ControlResponse::Error` becomes a
/// refusal.
pub type Serve = dyn Fn(u64, ControlRequest) -> ControlResponse + Send + Sync;

/// Told the session of a [`Loopback`] connection that closed.
pub type Closed = dyn Fn(u64) + Send + Sync;

/// One node a [`Loopback`] serves.
struct Endpoint {
    node_id: u32,
    name: String,
    serve: Arc<Serve>,
    closed: Option<Arc<Closed>>,
    /// Taken down: connections fail, calls on open ones fail as if the node died.
    down: AtomicBool,
}

/// Control connections in process: nodes are functions registered under an address
/// ([`Loopback::serve`]); each connection is a session, numbered from 1 across every node
/// served (session ids are unique in a cluster: a primary that takes over never hands out one
/// the old primary did). Calls run
/// on the caller's thread, so they never time out; a node taken down
/// ([`Loopback::set_down`]) fails them as a dead one would.
#[derive(Default)]
pub struct Loopback {
    endpoints: RwLock<HashMap<String, Arc<Endpoint>>>,
    /// The last session id handed out.
    sessions: AtomicU64,
}

impl Loopback {
    pub fn new() -> Loopback {
        Loopback::default()
    }

    /// Serves node `node_id` (named `name`) at `addr` with `serve` (replacing what served
    /// there); `closed`, if given, is told each session whose connection closes.
    pub fn serve(
        &self,
        addr: &str,
        node_id: u32,
        name: &str,
        serve: impl Fn(u64, ControlRequest) -> ControlResponse + Send + Sync + 'static,
        closed: Option<Arc<Closed>>,
    ) {
        let e = Endpoint {
            node_id,
            name: name.into(),
            serve: Arc::new(serve),
            closed,
            down: AtomicBool::new(false),
        };
        self.endpoints
            .write()
            .expect("loopback endpoints")
            .insert(addr.into(), Arc::new(e));
    }

    /// Takes the node at `addr` down (`true`) or brings it back.
    pub fn set_down(&self, addr: &str, down: bool) {
        if let Some(e) = self.endpoints.read().expect("loopback endpoints").get(addr) {
            e.down.store(down, Ordering::SeqCst);
        }
    }
}

impl Dial for Loopback {
    fn connect(
        &self,
        addr: &str,
        _secret: &Secret,
        _client_name: &str,
    ) -> Result<Arc<dyn ControlLink>, RpcError> {
        let e = self
            .endpoints
            .read()
            .expect("loopback endpoints")
            .get(addr)
            .cloned();
        let refused = |reason: &str| {
            RpcError::Connection(VerbsError::Connect {
                peer: addr.into(),
                reason: reason.into(),
            })
        };
        let e = e.ok_or_else(|| refused("nothing serves this address"))?;
        if e.down.load(Ordering::SeqCst) {
            return Err(refused("the node is down"));
        }
        let session = self.sessions.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Arc::new(LoopLink {
            peer: addr.into(),
            endpoint: e,
            session,
        }))
    }
}

/// A [`Loopback`] connection: one session on its node.
struct LoopLink {
    peer: String,
    endpoint: Arc<Endpoint>,
    session: u64,
}

impl ControlLink for LoopLink {
    fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError> {
        if self.endpoint.down.load(Ordering::SeqCst) {
            return Err(RpcError::Connection(VerbsError::ConnectionLost {
                peer: self.peer.clone(),
                reason: "the node is down".into(),
            }));
        }
        let resp = match req {
            ControlRequest::Hello { version } => ControlResponse::Hello { version: *version },
            ControlRequest::Session => ControlResponse::Session { id: self.session },
            other => (self.endpoint.serve)(self.session, other.clone()),
        };
        match resp {
            ControlResponse::Error { code, message } => Err(RpcError::Refused { code, message }),
            other => Ok(other),
        }
    }

    /// In process nothing waits on the network: there is no deadline to keep.
    fn set_deadline(&self, _d: Duration) {}

    fn peer(&self) -> &str {
        &self.peer
    }

    fn node_id(&self) -> u32 {
        self.endpoint.node_id
    }

    fn node_name(&self) -> &str {
        &self.endpoint.name
    }
}

impl Drop for LoopLink {
    fn drop(&mut self) {
        if let Some(closed) = &self.endpoint.closed {
            closed(self.session);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ErrorCode;

    fn secret() -> Secret {
        Secret::new(b"loopback-unit-secret").expect("a secret")
    }

    #[test]
    fn a_loopback_connection_is_a_session_and_a_node_taken_down_fails_it() {
        let lo = Loopback::new();
        let closed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = closed.clone();
        lo.serve(
            "n0",
            3,
            "node-three",
            |session, req| match req {
                ControlRequest::Stats => ControlResponse::Error {
                    code: ErrorCode::Invalid,
                    message: format!("no stats for session {session}"),
                },
                _ => ControlResponse::Ok,
            },
            Some(Arc::new(move |s| seen.lock().unwrap().push(s))),
        );
        let a = lo.connect("n0", &secret(), "a").unwrap();
        let b = lo.connect("n0", &secret(), "b").unwrap();
        let session = |l: &dyn ControlLink| match l.call(&ControlRequest::Session) {
            Ok(ControlResponse::Session { id }) => id,
            other => panic!("{other:?}"),
        };
        assert_eq!((session(&*a), session(&*b)), (1, 2));
        assert_eq!(
            (a.node_id(), a.node_name(), a.peer()),
            (3, "node-three", "n0")
        );
        assert_eq!(
            b.call(&ControlRequest::Stats),
            Err(RpcError::Refused {
                code: ErrorCode::Invalid,
                message: "no stats for session 2".into()
            })
        );
        drop(a);
        assert_eq!(*closed.lock().unwrap(), vec![1]);

        lo.set_down("n0", true);
        let lost = b.call(&ControlRequest::Cluster).unwrap_err();
        assert!(matches!(lost, RpcError::Connection(_)), "{lost:?}");
        assert!(lo.connect("n0", &secret(), "c").is_err());
        assert!(lo.connect("elsewhere", &secret(), "c").is_err());
        lo.set_down("n0", false);
        assert_eq!(b.call(&ControlRequest::Cluster), Ok(ControlResponse::Ok));
    }

    #[test]
    fn a_link_reads_a_data_node_s_answers_and_names_one_that_does_not_fit() {
        let lo = Loopback::new();
        lo.serve(
            "n1",
            1,
            "node-one",
            |_, req| match req {
                ControlRequest::Alloc { len, tag, .. } => ControlResponse::Allocated {
                    rkey: 7,
                    region_len: 1 << 20,
                    offset: 4096 + tag.unwrap_or(0),
                    len,
                },
                ControlRequest::Resize { offset, .. } => ControlResponse::Allocated {
                    rkey: 7,
                    region_len: 1 << 20,
                    offset: offset + 8192,
                    len: 0,
                },
                ControlRequest::Free { offset, .. } => ControlResponse::Freed { len: offset },
                ControlRequest::Resolve { extents } => ControlResponse::Resolved(Resolved {
                    changed: extents.into_iter().map(|e| (e, None)).collect(),
                    moved: Vec::new(),
                }),
                ControlRequest::Stats => ControlResponse::Stats(Box::new(NodeStats {
                    node_id: 1,
                    ..NodeStats::default()
                })),
                _ => ControlResponse::Ok,
            },
            None,
        );
        let l = lo.connect("n1", &secret(), "primary").unwrap();
        let (region, offset) = l.alloc_tagged(4096, 4096, Some(3)).unwrap();
        assert_eq!((region.rkey, region.len, offset), (7, 1 << 20, 4099));
        assert_eq!(l.resize(4096, 8192, 3, 3), Ok(12288));
        assert_eq!(l.free(4096, None), Ok(4096));
        assert_eq!(l.stats().map(|s| s.node_id), Ok(1));
        let gone = l.resolve(vec![(4096, 3)]).unwrap();
        assert_eq!(gone.changed, vec![((4096, 3), None)]);
        let unexpected = l.cluster().unwrap_err();
        assert!(
            matches!(&unexpected, RpcError::Unexpected { peer, what } if peer == "n1" && what == "Ok"),
            "{unexpected:?}"
        );
    }
}
