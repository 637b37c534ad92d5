//! The blocking control-RPC client of one memory node, used by mounts, the CLI, joining
//! nodes and the primary itself.
//!
//! Every call has a deadline ([`RPC_DEADLINE`] unless [`ControlClient::set_deadline`] says
//! otherwise): a node that stops answering (stopped, wedged, unreachable) turns into
//! [`RpcError::Timeout`] naming the node, never a caller blocked for good. The connection, and
//! with it the session (open files, lock slot, QoS slot), survives a timeout: the answer to a
//! timed-out call is read and dropped by a later call, so the client serves again as soon as
//! the node does. A call that timed out may still take effect when the node resumes, even
//! after calls made since (the node carries out a session's requests concurrently).
//!
//! Calls from several threads share the connection: each request carries an id, the node may
//! answer them in any order, and whichever caller is reading files the others' answers. Two
//! calls are ordered only when one returned before the other began.

use crate::link::ControlLink;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;
use std::thread::Thread;
use std::time::{Duration, Instant};

use rackfs_verbs::auth::{client_handshake, Accepted, Secret};
use rackfs_verbs::poll::{Poller, CONTROL_POLL};
use rackfs_verbs::wire::{self, ConnKind, FrameKind, HEADER_LEN};
use rackfs_verbs::{RegionInfo, VerbsError};

use crate::control::{
    ClusterInfo, ControlRequest, ControlResponse, ErrorCode, NodeStats, Refusal, Resolved,
    PROTOCOL_VERSION,
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
    /// The node did not answer within the deadline.
    #[error("memory node {node} ({peer}) did not answer within {after:?}")]
    Timeout {
        node: String,
        peer: String,
        after: Duration,
    },
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

/// How long one control RPC may take before it fails with [`RpcError::Timeout`].
pub const RPC_DEADLINE: Duration = Duration::from_secs(5);

/// A connected socket whose reads and writes can be bounded in time.
trait Socket: Read + Write + Send + AsRawFd {
    fn bound_reads(&self, d: Duration) -> std::io::Result<()>;
    fn bound_writes(&self, d: Duration) -> std::io::Result<()>;
    /// A second handle on the same connection (one side reads, the other writes).
    fn duplicate(&self) -> std::io::Result<Box<dyn Socket>>;
    fn bound(&self, d: Duration) -> std::io::Result<()> {
        self.bound_reads(d)?;
        self.bound_writes(d)
    }
}

impl Socket for TcpStream {
    fn bound_reads(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))
    }
    fn bound_writes(&self, d: Duration) -> std::io::Result<()> {
        self.set_write_timeout(Some(d))
    }
    fn duplicate(&self) -> std::io::Result<Box<dyn Socket>> {
        Ok(Box::new(self.try_clone()?))
    }
}

impl Socket for UnixStream {
    fn bound_reads(&self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))
    }
    fn bound_writes(&self, d: Duration) -> std::io::Result<()> {
        self.set_write_timeout(Some(d))
    }
    fn duplicate(&self) -> std::io::Result<Box<dyn Socket>> {
        Ok(Box::new(self.try_clone()?))
    }
}

/// The timeout a socket side has, set again only when it is off by more than a call can
/// afford: two system calls per round trip saved, for an overshoot of at most 1/64 of the
/// time left (a shorter timeout than needed only makes the caller read again).
#[derive(Default)]
struct Bound(Option<Duration>);

impl Bound {
    fn fits(&self, left: Duration) -> bool {
        self.0
            .is_some_and(|b| b >= left / 2 && b <= left + left / 64)
    }
}

/// The sending side: the socket, and the unsent rest of a request whose write the deadline
/// cut short (sent first by the next call, so frames never interleave).
struct Outbox {
    socket: Box<dyn Socket>,
    unsent: Vec<u8>,
    bound: Bound,
}

impl Outbox {
    /// Writes `frame` after whatever is unsent, by `deadline`; what the deadline leaves unsent
    /// stays queued (the next call sends it first) and the call times out. A call whose
    /// deadline passed before it got here sends nothing.
    fn send(&mut self, frame: &[u8], deadline: Instant) -> Result<(), std::io::Error> {
        if Instant::now() >= deadline {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.unsent.extend_from_slice(frame);
        while !self.unsent.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            if !self.bound.fits(left) {
                self.bound.0 = None;
                self.socket.bound_writes(left)?;
                self.bound.0 = Some(left);
            }
            match self.socket.write(&self.unsent) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => drop(self.unsent.drain(..n)),
                // Cut short by the socket's timeout: go on until the deadline itself.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted || timed_out(&e) => {}
                Err(e) => return Err(e),
            }
        }
        self.socket.flush()
    }
}

/// The receiving side: the socket and bytes received that do not make a whole frame yet (a
/// read cut short by the deadline leaves them here).
struct Inbox {
    socket: Box<dyn Socket>,
    bytes: Vec<u8>,
    bound: Bound,
}

impl Inbox {
    /// The next whole frame received, if there is one.
    fn take_frame(&mut self) -> Result<Option<(FrameKind, Vec<u8>)>, wire::WireError> {
        if self.bytes.len() < HEADER_LEN {
            return Ok(None);
        }
        let h: [u8; HEADER_LEN] = self.bytes[..HEADER_LEN].try_into().expect("header");
        let (kind, len) = wire::decode_header(&h)?;
        let end = HEADER_LEN + len as usize;
        if self.bytes.len() < end {
            return Ok(None);
        }
        let body = self.bytes[HEADER_LEN..end].to_vec();
        self.bytes.drain(..end);
        Ok(Some((kind, body)))
    }
}

/// What one read of the connection brought.
enum Received {
    /// Whole responses, by request id (maybe none: the deadline passed first).
    Answers(Vec<(u64, ControlResponse)>),
    /// The connection is unusable from here on.
    Broken(RpcError),
}

/// The calls in flight on one connection. At most one caller at a time reads the socket
/// (`reading`); it files every answer it receives under its request id and wakes the others,
/// so concurrent calls share the connection without a thread of its own and a lone caller
/// reads its answer itself.
#[derive(Default)]
struct Calls {
    next_id: u64,
    /// Requests whose callers still wait, with the caller's thread (an answer to any other id
    /// is a late one, dropped). Each sleeps parked until its own answer is filed, the reader
    /// hands it the reading, or the connection breaks: one wake-up per answer, not one for
    /// every waiter.
    waiting: std::collections::HashMap<u64, Thread>,
    answers: std::collections::HashMap<u64, ControlResponse>,
    reading: bool,
    broken: Option<RpcError>,
}

impl Calls {
    /// Wakes every caller still waiting (the connection broke).
    fn wake_all(&self) {
        self.waiting.values().for_each(Thread::unpark);
    }
}

/// A blocking control-RPC client of one memory node. Calls from several threads are in
/// flight together on its one connection (multiplexed by request id); the node answers them
/// in any order.
pub struct ControlClient {
    peer: String,
    node_id: u32,
    node_name: String,
    regions: Vec<RegionInfo>,
    deadline: Mutex<Duration>,
    /// How the reader polls for answers before it sleeps ([`rackfs_verbs::poll`]).
    poller: Poller,
    outbox: Mutex<Outbox>,
    /// Locked only by the caller that set [`Calls::reading`].
    inbox: Mutex<Inbox>,
    calls: Mutex<Calls>,
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
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
        let s = rackfs_verbs::tcp::dial(addr)?;
        Self::new(addr.into(), Box::new(s), secret, client_name)
    }

    /// Connects over the node's Unix socket.
    pub fn connect_unix(path: &Path, secret: &Secret, client_name: &str) -> Result<Self, RpcError> {
        let peer = format!("unix:{}", path.display());
        let s = UnixStream::connect(path).map_err(|e| VerbsError::Connect {
            peer: peer.clone(),
            reason: e.to_string(),
        })?;
        Self::new(peer, Box::new(s), secret, client_name)
    }

    /// Authenticates on `socket` and checks the node's protocol version, both within the
    /// deadline.
    fn new(
        peer: String,
        mut socket: Box<dyn Socket>,
        secret: &Secret,
        client_name: &str,
    ) -> Result<Self, RpcError> {
        let io = |e: std::io::Error| VerbsError::Connect {
            peer: peer.clone(),
            reason: e.to_string(),
        };
        socket.bound(RPC_DEADLINE).map_err(io)?;
        let acc: Accepted = client_handshake(
            &mut socket,
            ConnKind::Control,
            secret,
            client_name,
            0,
            &peer,
        )?;
        let reading = socket.duplicate().map_err(io)?;
        let c = ControlClient {
            peer,
            node_id: acc.welcome.node_id,
            node_name: acc.node_name,
            regions: acc.welcome.regions,
            deadline: Mutex::new(RPC_DEADLINE),
            poller: Poller::new(CONTROL_POLL),
            outbox: Mutex::new(Outbox {
                socket,
                unsent: Vec::new(),
                bound: Bound::default(),
            }),
            inbox: Mutex::new(Inbox {
                socket: reading,
                bytes: Vec::new(),
                bound: Bound::default(),
            }),
            calls: Mutex::new(Calls::default()),
        };
        c.hello(PROTOCOL_VERSION)?;
        Ok(c)
    }

    /// Sets how long each call may take from now on.
    pub fn set_deadline(&self, d: Duration) {
        *self.deadline.lock().expect("deadline lock") = d.max(Duration::from_millis(1));
    }

    /// Sets how long a caller waiting for an answer polls the socket before it sleeps (0:
    /// never polls).
    pub fn set_poll(&self, d: Duration) {
        self.poller.set(d);
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

    fn lost(&self, reason: String) -> RpcError {
        RpcError::Connection(VerbsError::ConnectionLost {
            peer: self.peer.clone(),
            reason,
        })
    }

    /// Sends one request and waits for its response, at most the deadline; an error response
    /// becomes `Refused`. Other threads' calls proceed meanwhile on the same connection.
    pub fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError> {
        self.call_sent(req, &mut || {})
    }

    /// [`ControlClient::call`], calling `sent` once the request is written (or its rest queued
    /// to go first with the next call's), before waiting for the answer.
    pub fn call_sent(
        &self,
        req: &ControlRequest,
        sent: &mut dyn FnMut(),
    ) -> Result<ControlResponse, RpcError> {
        let after = *self.deadline.lock().expect("deadline lock");
        let deadline = Instant::now() + after;
        let timeout = || RpcError::Timeout {
            node: self.node_name.clone(),
            peer: self.peer.clone(),
            after,
        };
        let id = {
            let mut calls = self.calls.lock().expect("calls lock");
            if let Some(e) = &calls.broken {
                return Err(e.clone());
            }
            let id = calls.next_id;
            calls.next_id += 1;
            calls.waiting.insert(id, std::thread::current());
            id
        };
        let body = req.encode(id);
        let mut frame = wire::encode_header(FrameKind::ControlRequest, body.len()).to_vec();
        frame.extend_from_slice(&body);
        let written = {
            let mut out = self.outbox.lock().expect("control outbox lock");
            out.send(&frame, deadline)
        };
        sent();
        if let Err(e) = written {
            let mut calls = self.calls.lock().expect("calls lock");
            calls.waiting.remove(&id);
            if timed_out(&e) {
                return Err(timeout());
            }
            let err = self.lost(e.to_string());
            calls.broken = Some(err.clone());
            calls.wake_all();
            return Err(err);
        }
        let mut calls = self.calls.lock().expect("calls lock");
        loop {
            if let Some(resp) = calls.answers.remove(&id) {
                return match resp {
                    ControlResponse::Error { code, message } => {
                        Err(RpcError::Refused { code, message })
                    }
                    other => Ok(other),
                };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(e) = &calls.broken {
                let e = e.clone();
                calls.waiting.remove(&id);
                return Err(e);
            }
            if left.is_zero() {
                calls.waiting.remove(&id);
                return Err(timeout());
            }
            if calls.reading {
                // An unpark meanwhile (its answer filed) makes the park return at once.
                drop(calls);
                std::thread::park_timeout(left);
                calls = self.calls.lock().expect("calls lock");
                continue;
            }
            calls.reading = true;
            drop(calls);
            let got = self.receive(left);
            calls = self.calls.lock().expect("calls lock");
            calls.reading = false;
            match got {
                Received::Answers(answers) => {
                    for (rid, resp) in answers {
                        if let Some(caller) = calls.waiting.remove(&rid) {
                            calls.answers.insert(rid, resp);
                            if rid != id {
                                caller.unpark();
                            }
                        }
                    }
                }
                Received::Broken(e) => {
                    calls.broken = Some(e);
                    calls.wake_all();
                }
            }
            // About to leave (its answer in, or its deadline passed): another waiter reads on.
            if calls.answers.contains_key(&id) || Instant::now() >= deadline {
                if let Some((_, next)) = calls.waiting.iter().find(|(&w, _)| w != id) {
                    next.unpark();
                }
            }
        }
    }

    /// Reads the connection once (at most `left`) and returns the whole responses received.
    /// Every read files all the whole frames it completes, so between reads the inbox holds
    /// at most the start of one.
    fn receive(&self, left: Duration) -> Received {
        let mut inbox = self.inbox.lock().expect("control inbox lock");
        let mut buf = [0u8; 16 << 10];
        if !inbox.bound.fits(left) {
            inbox.bound.0 = None;
            if let Err(e) = inbox.socket.bound_reads(left) {
                return Received::Broken(self.lost(e.to_string()));
            }
            inbox.bound.0 = Some(left);
        }
        // The answer mostly comes within the poll: no sleep, no wake-up for it.
        let Inbox { socket, .. } = &mut *inbox;
        let fd = socket.as_raw_fd();
        let got = self.poller.read(&fd, &mut buf, |b| socket.read(b));
        match got {
            Ok(0) => return Received::Broken(self.lost("the node closed the connection".into())),
            Ok(n) => inbox.bytes.extend_from_slice(&buf[..n]),
            Err(e) if timed_out(&e) || e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Received::Broken(self.lost(e.to_string())),
        }
        let mut answers = Vec::new();
        loop {
            let what = match inbox.take_frame() {
                Ok(None) => return Received::Answers(answers),
                Ok(Some((FrameKind::ControlResponse, body))) => {
                    match ControlResponse::decode(&body) {
                        Ok(a) => {
                            answers.push(a);
                            continue;
                        }
                        Err(e) => e.to_string(),
                    }
                }
                Ok(Some((kind, _))) => format!("a {kind:?} frame"),
                Err(e) => return Received::Broken(self.lost(e.to_string())),
            };
            return Received::Broken(RpcError::Unexpected {
                peer: self.peer.clone(),
                what,
            });
        }
    }

    fn mismatch(&self, got: ControlResponse) -> RpcError {
        RpcError::Unexpected {
            peer: self.peer.clone(),
            what: format!("{got:?}"),
        }
    }

    /// The node's counters ([`ControlLink::stats`]).
    pub fn stats(&self) -> Result<NodeStats, RpcError> {
        ControlLink::stats(self)
    }

    /// Allocates an extent; returns its region and offset.
    pub fn alloc(&self, len: u64, align: u64) -> Result<(RegionInfo, u64), RpcError> {
        self.alloc_tagged(len, align, None)
    }

    /// [`ControlLink::alloc_tagged`].
    pub fn alloc_tagged(
        &self,
        len: u64,
        align: u64,
        tag: Option<u64>,
    ) -> Result<(RegionInfo, u64), RpcError> {
        ControlLink::alloc_tagged(self, len, align, tag)
    }

    /// [`ControlLink::resize`].
    pub fn resize(&self, offset: u64, len: u64, tag: u64, expect: u64) -> Result<u64, RpcError> {
        ControlLink::resize(self, offset, len, tag, expect)
    }

    /// [`ControlLink::resolve`].
    pub fn resolve(&self, extents: Vec<(u64, u64)>) -> Result<Resolved, RpcError> {
        ControlLink::resolve(self, extents)
    }

    /// [`ControlLink::free`].
    pub fn free(&self, offset: u64, tag: Option<u64>) -> Result<u64, RpcError> {
        ControlLink::free(self, offset, tag)
    }

    pub fn cluster(&self) -> Result<ClusterInfo, RpcError> {
        match self.call(&ControlRequest::Cluster)? {
            ControlResponse::Cluster(c) => Ok(*c),
            other => Err(self.mismatch(other)),
        }
    }

    /// A namespace operation on the primary.
    pub fn meta(&self, req: MetaRequest) -> Result<ControlResponse, RpcError> {
        self.call(&ControlRequest::Meta(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_verbs::auth::{server_handshake, NonceLog};
    use rackfs_verbs::wire::Welcome;
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::Arc;

    /// A node of the test's making on a Unix socket: it authenticates one client and answers
    /// its hello; every other request goes to the test as (id, request), and what the test
    /// sends back as (id, response) is written to the client in that order.
    struct FakeNode {
        client: Arc<ControlClient>,
        requests: Receiver<(u64, ControlRequest)>,
        answers: Sender<(u64, ControlResponse)>,
    }

    /// A fake node and a client of it whose calls wait up to `deadline`.
    fn fake_node(deadline: Duration) -> FakeNode {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "rackfs-fake-node-{}-{}.sock",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let secret = Secret::new(b"fake node secret").unwrap();
        let (req_tx, requests) = channel();
        let (answers, ans_rx) = channel::<(u64, ControlResponse)>();
        let server_secret = secret.clone();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let welcome = Welcome {
                proof: [0; rackfs_verbs::wire::PROOF_LEN],
                node_name: "fake".into(),
                node_id: 9,
                regions: Vec::new(),
            };
            server_handshake(
                &mut s,
                &server_secret,
                &welcome,
                &NonceLog::default(),
                |_| Ok(()),
            )
            .unwrap();
            let out = Arc::new(std::sync::Mutex::new(s.try_clone().unwrap()));
            let writer = out.clone();
            std::thread::spawn(move || {
                for (id, resp) in ans_rx {
                    let mut w = writer.lock().unwrap();
                    if id == HANG_UP {
                        let _ = w.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    if wire::write_frame(&mut *w, FrameKind::ControlResponse, &resp.encode(id))
                        .is_err()
                    {
                        return;
                    }
                }
            });
            let mut body = Vec::new();
            while wire::read_frame(&mut s, &mut body).is_ok() {
                let (id, req) = ControlRequest::decode(&body).unwrap();
                if let ControlRequest::Hello { version } = req {
                    let hello = ControlResponse::Hello { version };
                    let mut w = out.lock().unwrap();
                    wire::write_frame(&mut *w, FrameKind::ControlResponse, &hello.encode(id))
                        .unwrap();
                } else if req_tx.send((id, req)).is_err() {
                    return;
                }
            }
        });
        let client = ControlClient::connect_unix(&path, &secret, "test").unwrap();
        client.set_deadline(deadline);
        let _ = std::fs::remove_file(&path);
        FakeNode {
            client: Arc::new(client),
            requests,
            answers,
        }
    }

    /// The answer id that has the fake node close the connection instead.
    const HANG_UP: u64 = u64::MAX;

    /// A request the fake node answers with a refusal naming `n`, so each caller can tell its
    /// own answer.
    fn numbered(n: u64) -> ControlRequest {
        ControlRequest::Alloc {
            len: n,
            align: 1,
            tag: None,
        }
    }

    fn answer_to(req: &ControlRequest) -> ControlResponse {
        let ControlRequest::Alloc { len, .. } = req else {
            panic!("unexpected request {req:?}");
        };
        ControlResponse::error(ErrorCode::Invalid, len.to_string())
    }

    /// Many threads' calls on one connection, answered in batches in reverse order: each caller
    /// gets its own answer, woken by it (not at its deadline).
    #[test]
    fn answers_in_any_order_reach_their_callers() {
        let FakeNode {
            client,
            requests,
            answers,
        } = fake_node(Duration::from_secs(3));
        const THREADS: u64 = 8;
        const CALLS: u64 = 100;
        let server = std::thread::spawn(move || {
            let mut left = THREADS * CALLS;
            while left > 0 {
                let mut batch = vec![requests.recv().unwrap()];
                while let Ok(r) = requests.recv_timeout(Duration::from_micros(200)) {
                    batch.push(r);
                }
                left -= batch.len() as u64;
                for (id, req) in batch.into_iter().rev() {
                    answers.send((id, answer_to(&req))).unwrap();
                }
            }
        });
        let callers: Vec<_> = (0..THREADS)
            .map(|t| {
                let c = client.clone();
                std::thread::spawn(move || {
                    for i in 0..CALLS {
                        let n = t * CALLS + i;
                        let began = Instant::now();
                        match c.call(&numbered(n)) {
                            Err(RpcError::Refused { message, .. }) => {
                                assert_eq!(message, n.to_string(), "another caller's answer")
                            }
                            other => panic!("call {n}: {other:?}"),
                        }
                        // Each is answered within milliseconds; a caller nobody woke would
                        // find its answer only when its 3 s deadline ended its sleep.
                        assert!(
                            began.elapsed() < Duration::from_secs(2),
                            "call {n} was not woken by its answer"
                        );
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
        server.join().unwrap();
    }

    /// A connection that breaks wakes every caller waiting on it, with the error at once.
    #[test]
    fn a_broken_connection_fails_every_waiting_call() {
        let FakeNode {
            client,
            requests,
            answers,
        } = fake_node(Duration::from_secs(3));
        let callers: Vec<_> = (0..4)
            .map(|n| {
                let c = client.clone();
                std::thread::spawn(move || {
                    let began = Instant::now();
                    (c.call(&numbered(n)), began.elapsed())
                })
            })
            .collect();
        for _ in 0..4 {
            requests.recv().unwrap();
        }
        answers.send((HANG_UP, ControlResponse::Ok)).unwrap();
        for c in callers {
            let (got, took) = c.join().unwrap();
            assert!(
                matches!(got, Err(RpcError::Connection(_))),
                "a call on a closed connection: {got:?}"
            );
            assert!(took < Duration::from_secs(2), "not woken by the break");
        }
    }

    /// The caller reading the connection gives up at its deadline and hands the reading on: a
    /// caller waiting meanwhile still gets its answer, which comes after that deadline.
    #[test]
    fn a_reader_past_its_deadline_hands_the_reading_on() {
        let FakeNode {
            client,
            requests,
            answers,
        } = fake_node(Duration::from_millis(200));
        let c = client.clone();
        let first = std::thread::spawn(move || c.call(&numbered(1)));
        let (_, unanswered) = requests.recv().unwrap();
        assert_eq!(unanswered, numbered(1));
        // The first caller is alone, so it reads; the second waits for its answer meanwhile.
        std::thread::sleep(Duration::from_millis(50));
        client.set_deadline(Duration::from_secs(3));
        let c = client.clone();
        let started = Instant::now();
        let second = std::thread::spawn(move || c.call(&numbered(2)));
        let (id, req) = requests.recv().unwrap();
        assert!(matches!(
            first.join().unwrap(),
            Err(RpcError::Timeout { .. })
        ));
        std::thread::sleep(Duration::from_millis(300));
        answers.send((id, answer_to(&req))).unwrap();
        match second.join().unwrap() {
            Err(RpcError::Refused { message, .. }) => assert_eq!(message, "2"),
            other => panic!("the second call: {other:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the second caller waited out its deadline: {:?}",
            started.elapsed()
        );
    }
}
