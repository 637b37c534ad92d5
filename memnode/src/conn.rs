//! Client connections: accept loops, authentication, and serving each connection as the kind
//! it asked for.
//!
//! One thread per connection. A verbs connection's thread is a NIC: it executes work requests
//! and nothing else. A control connection is one client session; its thread answers RPCs
//! through [`control::answer`](crate::control::answer), joined by more while requests that
//! may wait are in flight (see `Session`), and the session ends once the connection closed
//! and every request in flight is answered. An shm connection's thread hands the client the
//! regions' memfds, then waits for the connection to close, which is how the node learns the
//! client is gone (its verb counters are then folded into the node's totals).

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rackfs_proto::control::{ControlRequest, ErrorCode, PROTOCOL_VERSION};
use rackfs_proto::Refusal;
use rackfs_verbs::auth::{server_handshake, Admitted, HandshakeError};
use rackfs_verbs::counters::COUNTER_BLOCK_LEN;
use rackfs_verbs::poll::Polled;
use rackfs_verbs::wire::{self, ConnKind, FrameKind, WireError};
use rackfs_verbs::{Access, Region, VerbCounters};
use tracing::{debug, info, warn};

use crate::fence::{Process, Stop};
use crate::node::Node;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub fn accept_tcp(listener: TcpListener, node: Arc<Node>) {
    for conn in listener.incoming() {
        if node.is_stopping() {
            return;
        }
        match conn {
            Ok(stream) => {
                let peer = stream
                    .peer_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string());
                let _ = stream.set_nodelay(true);
                let s = node.clone();
                spawn_conn(peer.clone(), move || serve_conn(stream, &peer, &s));
            }
            Err(e) => warn!(error = %e, "accept failed"),
        }
    }
}

pub fn accept_unix(listener: UnixListener, node: Arc<Node>) {
    for conn in listener.incoming() {
        if node.is_stopping() {
            return;
        }
        match conn {
            Ok(stream) => {
                let s = node.clone();
                spawn_conn("unix".into(), move || serve_conn(stream, "unix", &s));
            }
            Err(e) => warn!(error = %e, "accept failed"),
        }
    }
}

fn spawn_conn(peer: String, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = std::thread::Builder::new()
        .name(format!("conn-{peer}"))
        .spawn(f)
    {
        warn!(%peer, error = %e, "cannot start a connection thread; dropping the connection");
    }
}

/// Authenticates a fresh connection; logs and counts failures.
fn handshake<S: Read + Write>(
    stream: &mut S,
    peer: &str,
    node: &Node,
    unix: bool,
) -> Option<Admitted> {
    node.counters
        .connections_total
        .fetch_add(1, Ordering::Relaxed);
    let result = server_handshake(stream, &node.cfg.secret, &node.welcome, &node.nonces, |h| {
        if h.kind == ConnKind::Shm && !unix {
            Err("shm connections must use the memory node's Unix socket (--shm-socket)".into())
        } else if h.kind == ConnKind::Rdma && node.rdma.is_none() {
            Err("this memory node serves no RDMA clients (start it with --rdma-device NAME)".into())
        } else if h.kind != ConnKind::Control && !node.serving() {
            Err(format!(
                "memory node {}'s lease from the primary lapsed: it serves no data until the \
                 primary renews it",
                node.cfg.name
            ))
        } else if node.fences.is_fenced(h.fence) {
            Err(format!(
                "fenced: the lease of this mount's session {} expired and memory node {} \
                 executes nothing more from it (the mount continues in a new session)",
                h.fence, node.cfg.name
            ))
        } else {
            Ok(())
        }
    });
    match result {
        Ok(admitted) => {
            let hello = &admitted.hello;
            debug!(%peer, client = %hello.client_name, kind = ?hello.kind, fence = hello.fence, "client authenticated");
            Some(admitted)
        }
        Err(HandshakeError::Replay { client }) => {
            node.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            warn!(%peer, %client, "refused a replayed handshake (a client nonce used before)");
            None
        }
        Err(HandshakeError::WrongSecret { client }) => {
            node.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            warn!(%peer, %client, "refused a client: wrong cluster secret");
            None
        }
        Err(HandshakeError::NotAdmitted { client, reason }) => {
            info!(%peer, %client, %reason, "refused a client");
            None
        }
        Err(HandshakeError::Wire(WireError::Closed)) => None,
        Err(e) => {
            node.counters
                .protocol_errors
                .fetch_add(1, Ordering::Relaxed);
            warn!(%peer, error = %e, "handshake failed; closing the connection");
            None
        }
    }
}

fn log_end(node: &Node, peer: &str, what: &str, r: Result<(), WireError>) {
    match r {
        Ok(()) | Err(WireError::Closed) => debug!(%peer, "{what} connection closed"),
        Err(WireError::Io(e)) => debug!(%peer, error = %e, "{what} connection dropped"),
        Err(e) => {
            node.counters
                .protocol_errors
                .fetch_add(1, Ordering::Relaxed);
            warn!(%peer, error = %e, "closing {what} connection: malformed input");
        }
    }
}

/// A stream a client connects over: TCP or Unix.
trait Conn: Read + Write + AsRawFd + Into<OwnedFd> + Send + Sized + 'static {
    fn duplicate(&self) -> std::io::Result<Self>;
    fn set_timeout(&self, t: Option<Duration>);
    /// The Unix stream itself, for shm clients (`None` over TCP).
    fn into_unix(self) -> Option<UnixStream>;
}

impl Conn for TcpStream {
    fn duplicate(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn set_timeout(&self, t: Option<Duration>) {
        let _ = self.set_read_timeout(t);
    }
    fn into_unix(self) -> Option<UnixStream> {
        None
    }
}

impl Conn for UnixStream {
    fn duplicate(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn set_timeout(&self, t: Option<Duration>) {
        let _ = self.set_read_timeout(t);
    }
    fn into_unix(self) -> Option<UnixStream> {
        Some(self)
    }
}

/// Authenticates a connection and serves it as the kind of connection it asked for.
fn serve_conn<S: Conn>(mut stream: S, peer: &str, node: &Node) {
    // A socket's read timeout is the kernel's, on the host's time, not the node's clock: this
    // is plumbing between sockets and the node (so are the verbs NIC threads' lease checks,
    // on the host's clock the serve lease is kept on: see `Node::lease_ns`).
    stream.set_timeout(Some(HANDSHAKE_TIMEOUT));
    let unix = std::any::TypeId::of::<S>() == std::any::TypeId::of::<UnixStream>();
    let Some(admitted) = handshake(&mut stream, peer, node, unix) else {
        return;
    };
    let (kind, fence) = (admitted.hello.kind, admitted.hello.fence);
    stream.set_timeout(None);
    let _open = node.counters.open(kind);
    let Ok(clone) = stream.duplicate() else {
        return;
    };
    // A data connection may be fenced: it is stopped through a duplicate of its socket.
    let socket_stop = || stream.duplicate().ok().map(|s| Stop::Socket(s.into()));
    match kind {
        ConnKind::Verbs => {
            let Some(reg) = socket_stop().and_then(|s| node.fences.register(fence, s)) else {
                return;
            };
            let fd = (stream.as_raw_fd(), node.cfg.poll);
            let r = node.counters.with_verbs(VerbCounters::local(), |c| {
                rackfs_verbs::tcp::serve_verbs(
                    clone,
                    stream,
                    fd,
                    &node.table,
                    c,
                    (&reg.stop, &node.serve),
                    admitted.clock_offset_ns(),
                )
            });
            log_end(node, peer, "verbs", r);
        }
        ConnKind::Control => log_end(node, peer, "control", serve_control(clone, stream, node)),
        ConnKind::Shm => match stream.into_unix() {
            Some(u) => serve_shm(u, node, fence),
            None => unreachable!("refused in the handshake"),
        },
        ConnKind::Rdma => {
            let Some(_reg) = socket_stop().and_then(|s| node.fences.register(fence, s)) else {
                return;
            };
            let Ok(own) = stream.duplicate() else {
                return;
            };
            let own: Arc<OwnedFd> = Arc::new(own.into());
            node.lease_words.add_rdma(&own);
            let nic = node.rdma.as_ref().expect("refused in the handshake");
            match nic.serve(stream) {
                Ok(()) => debug!(%peer, "rdma client gone; its queue pair is destroyed"),
                Err(e) => warn!(%peer, error = %e, "rdma connection set-up failed"),
            }
        }
    }
}

fn serve_shm(mut stream: UnixStream, node: &Node, fence: u64) {
    let counters =
        match Region::create_memfd("rackfs-shm-counters", COUNTER_BLOCK_LEN, 0, Access::ALL) {
            Ok(r) => VerbCounters::in_region(Arc::new(r)),
            Err(e) => {
                warn!(error = %e, "cannot create an shm counter block; dropping the client");
                return;
            }
        };
    let Ok(socket) = stream.try_clone() else {
        return;
    };
    let stop = Stop::Shm {
        block: counters.region().clone(),
        process: Process::of_peer(&stream),
        socket: socket.into(),
    };
    let Some(_reg) = node.fences.register(fence, stop) else {
        return;
    };
    node.lease_words.add(counters.region(), &node.serve);
    if let Err(e) = rackfs_verbs::shm::send_regions(&stream, &node.table, counters.region()) {
        warn!(error = %e, "cannot send regions to an shm client");
        return;
    }
    node.counters.with_verbs(counters, |_| {
        // The client never writes here; the read returns when it disconnects or dies.
        let mut buf = [0u8; 64];
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
    });
    debug!("shm client disconnected");
}

/// Serves control RPCs; the connection is one client session (its opens end with it once
/// every request in flight is answered).
fn serve_control(
    r: impl Read + AsRawFd + Send,
    w: impl Write + Send,
    node: &Node,
) -> Result<(), WireError> {
    let session = node.next_session.fetch_add(1, Ordering::Relaxed);
    let conn = Session {
        node,
        id: session,
        requests: Mutex::new(Requests {
            reader: BufReader::new(Polled::new(r, node.cfg.poll)),
            body: Vec::new(),
        }),
        answers: Mutex::new(BufWriter::new(w)),
        crew: Mutex::new(Crew {
            workers: 1,
            ..Crew::default()
        }),
        turn: Condvar::new(),
        other_version: AtomicU32::new(0),
    };
    std::thread::scope(|s| conn.work(s));
    node.end_session(session);
    conn.crew
        .into_inner()
        .map_or(Ok(()), |c| c.end.unwrap_or(Ok(())))
}

/// How many requests of one session the node carries out at once (the threads serving it,
/// started only while that many wait at once). A session with this many requests waiting
/// reads no more until one ends (a mount has at most 64 FUSE threads).
const SESSION_WORKERS: usize = 64;

/// The reading side of a control connection.
struct Requests<R> {
    reader: BufReader<R>,
    body: Vec<u8>,
}

/// The threads serving one session, and who reads its next request.
#[derive(Default)]
struct Crew {
    workers: usize,
    /// Threads waiting for their turn to read, asleep.
    parked: usize,
    /// Threads waiting for their turn to read, polling for it before they park.
    polling: usize,
    /// Requests that may wait being carried out (each passed the turn on).
    handling: usize,
    /// Nobody holds the reading turn: the next thread free takes it.
    reading_free: bool,
    /// How the connection ended (closed, broken, malformed), once it did.
    end: Option<Result<(), WireError>>,
}

/// Whether answering `req` may wait on something other than this node's CPU: another node,
/// the coordinator, the metadata standby, the metadata lock held by a change, another
/// session's range lock, a long poll. The thread that read such a request passes the reading
/// of the next ones on first; any other request is answered by the thread that read it,
/// which costs no thread switch (most of a round trip on a local connection).
fn may_wait(node: &Node, req: &ControlRequest) -> bool {
    match req {
        // With a standby, even a read waits for changes in flight to reach it; with none in
        // flight it waits for nothing (one queued meanwhile only delays this connection).
        ControlRequest::Meta(m) => {
            !rackfs_meta::journal::Step::only_reads(m)
                || (node.standby.follower().is_some() && !node.standby.all_shipped())
        }
        ControlRequest::Hello { .. }
        | ControlRequest::Ping
        | ControlRequest::Stats
        | ControlRequest::Alloc { .. }
        | ControlRequest::Free { .. }
        | ControlRequest::FreeMany { .. }
        | ControlRequest::AllocMany { .. }
        | ControlRequest::Resize { .. }
        | ControlRequest::Zero { .. }
        | ControlRequest::Cluster
        | ControlRequest::Retag { .. }
        | ControlRequest::Resolve { .. }
        | ControlRequest::Session
        | ControlRequest::Primary { .. }
        | ControlRequest::Mirror { .. }
        | ControlRequest::Journal { .. }
        | ControlRequest::BaselineRangeUnlock { .. }
        | ControlRequest::QosShares { .. }
        | ControlRequest::QosStatus => false,
        _ => true,
    }
}

/// One client session being served. One thread at a time holds the turn to read the next
/// request. It answers a request that cannot wait ([`may_wait`]) itself and reads on, and so
/// a namespace change when no other request has come in yet; before one that may wait it
/// passes the turn to a parked thread, or starts one (up to [`SESSION_WORKERS`]), so that a
/// waiting request holds up no other. A thread done with such
/// a request takes the turn back if it is free, else parks. Answers go out in the order they
/// are ready, each under its request's id.
struct Session<'a, R, W: Write> {
    node: &'a Node,
    id: u64,
    /// Locked only by the thread holding the reading turn.
    requests: Mutex<Requests<R>>,
    answers: Mutex<BufWriter<W>>,
    crew: Mutex<Crew>,
    /// Signalled when the reading turn is free or the connection ended.
    turn: Condvar,
    /// The client's protocol version once it said hello with another one than ours (0: none).
    other_version: AtomicU32,
}

/// Ends the session if the thread holding it panics.
struct EndOnPanic<'s, 'a, R: Read + AsRawFd + Send, W: Write + Send>(&'s Session<'a, R, W>);

impl<R: Read + AsRawFd + Send, W: Write + Send> Drop for EndOnPanic<'_, '_, R, W> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.end(Err(WireError::malformed(
                "control request",
                "its handler panicked",
            )));
        }
    }
}

impl<'a, R: Read + AsRawFd + Send, W: Write + Send> Session<'a, R, W> {
    /// Serves requests, starting with the reading turn, until the connection ends.
    fn work<'s>(&'s self, scope: &'s std::thread::Scope<'s, '_>) {
        // A thread that panics ends the session, so no other waits for a turn it held.
        let _ended = EndOnPanic(self);
        loop {
            let (id, req) = match self.next_request() {
                Ok(r) => r,
                Err(e) => return self.end(Err(e)),
            };
            // A namespace change waits only for the metadata lock, the standby's copy of it
            // and frees, each bounded: with no other request in yet, the reading thread
            // carries it out itself, which saves waking another thread for each change of a
            // client that sends one at a time.
            let waits = may_wait(self.node, &req)
                && (!matches!(req, ControlRequest::Meta(_)) || self.more_requests());
            if waits {
                self.pass_turn(scope);
            }
            let resp = self.answer(req);
            let mut w = self.answers.lock().expect("answers lock");
            let sent = wire::write_frame(&mut *w, FrameKind::ControlResponse, &resp.encode(id))
                .and_then(|()| w.flush());
            drop(w);
            if let Err(e) = sent {
                return self.end(Err(e.into()));
            }
            if waits && !self.take_turn() {
                return;
            }
        }
    }

    /// Whether another request has come in (in part) since the last one was read.
    fn more_requests(&self) -> bool {
        let r = self.requests.lock().expect("requests lock");
        !r.reader.buffer().is_empty() || rackfs_verbs::poll::readable_now(r.reader.get_ref())
    }

    fn next_request(&self) -> Result<(u64, ControlRequest), WireError> {
        let mut r = self.requests.lock().expect("requests lock");
        let Requests { reader, body } = &mut *r;
        let kind = wire::read_frame(reader, body)?;
        if kind != FrameKind::ControlRequest {
            return Err(WireError::Unexpected {
                expected: FrameKind::ControlRequest,
                got: kind,
            });
        }
        ControlRequest::decode(body)
    }

    /// Gives up the reading turn: to a parked thread, else to a new one.
    fn pass_turn<'s>(&'s self, scope: &'s std::thread::Scope<'s, '_>) {
        let mut c = self.crew.lock().expect("crew lock");
        c.reading_free = true;
        c.handling += 1;
        if c.polling > 0 {
            // One of them takes it: no wake-up.
        } else if c.parked > 0 {
            self.turn.notify_one();
        } else if c.workers < SESSION_WORKERS {
            let started = std::thread::Builder::new()
                .name(format!("session-{}", self.id))
                .spawn_scoped(scope, move || self.work(scope));
            if started.is_ok() {
                c.workers += 1;
                c.reading_free = false;
            }
        }
        // Else every thread is busy: the first one done takes the turn.
    }

    /// Done with a request that may wait: waits for the reading turn, parked; false once the
    /// connection ended. While other such requests are still being carried out (a client
    /// with several in flight, whose next one comes soon), it polls for the turn for up to
    /// the node's poll time first: the holder passes it on as soon as it reads one, and a
    /// parked thread would cost a wake-up. A client with one request at a time never has it
    /// poll (two threads spinning on two CPUs cost that client more than the wake-up).
    fn take_turn(&self) -> bool {
        let mut c = self.crew.lock().expect("crew lock");
        c.handling -= 1;
        if c.handling > 0 {
            let clock = &self.node.clock;
            let until = clock.now() + self.node.cfg.poll;
            c.polling += 1;
            while c.end.is_none() && !c.reading_free && clock.now() < until {
                drop(c);
                std::thread::yield_now();
                c = self.crew.lock().expect("crew lock");
            }
            c.polling -= 1;
        }
        loop {
            if c.end.is_some() {
                return false;
            }
            if c.reading_free {
                c.reading_free = false;
                return true;
            }
            c.parked += 1;
            c = self.turn.wait(c).expect("crew lock");
            c.parked -= 1;
        }
    }

    /// The connection ended: every parked thread leaves, and the others once done.
    fn end(&self, how: Result<(), WireError>) {
        let mut c = self.crew.lock().unwrap_or_else(|e| e.into_inner());
        c.end.get_or_insert(how);
        self.turn.notify_all();
    }

    fn answer(&self, req: ControlRequest) -> rackfs_proto::control::ControlResponse {
        if let ControlRequest::Hello { version } = req {
            if version != PROTOCOL_VERSION {
                warn!(
                    session = self.id,
                    client = version,
                    node = PROTOCOL_VERSION,
                    "a client speaks another protocol version; refusing its requests"
                );
                self.other_version.store(version, Ordering::SeqCst);
            }
        }
        match self.other_version.load(Ordering::SeqCst) {
            v if v != 0 && !matches!(req, ControlRequest::Hello { .. }) => Refusal::new(
                ErrorCode::Version,
                format!("this node speaks protocol version {PROTOCOL_VERSION}, the client {v}"),
            )
            .into(),
            _ => crate::control::answer(self.node, self.id, req),
        }
    }
}
