//! The `rdma` transport: reliable-connected queue pairs on an RDMA device (feature `rdma`).
//!
//! **Set-up** goes over the node's TCP listener: the client authenticates as for every
//! connection (kind `Rdma`), sends its queue pair's endpoint (QP number, PSN, LID, GID), and
//! the node answers with its own queue pair's endpoint and, per region, the registration's
//! address and RDMA key. The TCP connection then stays open and idle: its end tells the node
//! to destroy the queue pair (and is how a dead client is noticed), as with shm.
//!
//! **Data path**: the node's CPU takes no part. A batch becomes chains of work requests posted
//! behind one doorbell each, only the last signalled, each request's id naming its chain.
//! Posting returns once the chains are on the send queue: many batches may be in flight on
//! one queue pair, as on tcp, executing in posting order. The send queue never holds more than
//! `DEPTH` requests, and each chain takes its span of a registered bounce buffer (a ring of
//! [`crate::MAX_BATCH_BYTES`] and a little more): READ results and atomic old values land there,
//! WRITE data is copied there first. A post waits for room (completing what has completed)
//! for at most its batch's deadline. Waiters take turns polling the completion queue (busy at
//! first, then yielding, then sleeping with growing pauses): the one polling completes every
//! batch whose last chain completed, then hands the polling to another waiter. Masked
//! atomics, which plain RDMA devices do not have, are emulated with CAS loops that start from
//! a guess and learn the word from each failed CAS (every step is one atomic, so the result is
//! atomic against every other atomic on the region); a chain is split around them, and each
//! step is waited for before anything more is posted (nothing after a masked atomic may run
//! before it), so a batch with one is posted synchronously.
//!
//! **Errors**: each request is checked against the region's key, access, bounds and alignment
//! before posting, so a bad request fails alone with the same specific error as on tcp and
//! shm and the rest of its batch is flushed. A work completion in error (the queue pair is
//! then in the error state) fails its own batch with the device's status; the batches posted
//! behind it on that queue pair fail as flushed (whether they ran is unknown); those that
//! completed before it keep their results. A batch not complete by its deadline
//! (`COMPLETION_TIMEOUT`, or `connect_with_deadline`'s) fails likewise. The queue pair is
//! then torn down and a new one is connected on the next post.
//!
//! **The node's own atomics** ([`NodeAtomics`]): on a device whose atomics are atomic only
//! among its own requests (`atomic_cap` HCA), the node's CPU atomics on its regions would race
//! with the clients' RDMA atomics; [`RdmaNic`] then routes the regions' owner atomics
//! (`Region::compare_swap`, `Region::store_shared`) through a loopback queue pair.
//!
//! Verbs on this transport are not seen by the node's counters.

#[cfg(feature = "rdma")]
mod device;

use crate::wr::Batch;
use crate::VerbsError;

#[cfg(feature = "rdma")]
pub use imp::*;

#[cfg(not(feature = "rdma"))]
pub use absent::*;

/// Why a node could not serve RDMA, or one rdma client's set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum RdmaNicError {
    /// This build has no RDMA support (see [`not_built`]).
    #[error("{0}")]
    NotBuilt(String),
    #[error("RDMA device: {0}")]
    Device(String),
    #[error("registering region {rkey:#x}: {reason}")]
    Register { rkey: u32, reason: String },
    #[error("rdma set-up: {0}")]
    Wire(#[from] crate::wire::WireError),
    #[error("expected an rdma connect frame, got {0:?}")]
    UnexpectedFrame(crate::wire::FrameKind),
    #[error("rdma queue pair: {0}")]
    QueuePair(String),
}

/// Where a memory node's own atomics on its regions' words (the QoS monitor's token
/// hand-outs, the lock service's) execute when it serves RDMA clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeAtomics {
    /// Through a loopback queue pair when the device's atomics are atomic only among its own
    /// requests (`atomic_cap` HCA, as Soft-RoCE's and ConnectX's without global atomics), on
    /// the CPU otherwise (`atomic_cap` GLOB: the device's atomics interlock with the CPU's).
    Auto,
    /// On the CPU (races with the clients' RDMA atomics on an HCA-atomic device: tests only).
    Cpu,
    /// Through a loopback queue pair, whatever the device.
    Loopback,
}

/// The error every rdma entry point gives in a build without the `rdma` feature.
pub fn not_built() -> String {
    "this build has no RDMA support: rebuild with `--features rdma` (needs rdma-core's build \
     dependencies: cmake, clang, libnl-3-dev, libnl-route-3-dev)"
        .into()
}

#[cfg(not(feature = "rdma"))]
mod absent {
    use super::*;
    use crate::auth::Secret;
    use crate::qp::{Posted, QueuePair};
    use crate::region::{RegionInfo, RegionTable};

    /// An RDMA client connection (cannot exist in this build).
    pub struct RdmaConn {
        never: std::convert::Infallible,
    }

    impl RdmaConn {
        pub(crate) fn post(self: &std::sync::Arc<Self>, _: &Batch<'_>) -> Posted {
            match self.never {}
        }
        pub(crate) fn poll_slot(
            &self,
            _: &crate::qp::Slot,
            _: std::time::Instant,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<crate::Completions, VerbsError>> {
            match self.never {}
        }
        pub(crate) fn inject_remote_fault(&self) {
            match self.never {}
        }
        pub(crate) fn regions(&self) -> &[RegionInfo] {
            match self.never {}
        }
        pub(crate) fn node_id(&self) -> u32 {
            match self.never {}
        }
        pub(crate) fn peer(&self) -> &str {
            match self.never {}
        }
        pub fn atomics(&self) -> &str {
            match self.never {}
        }
        pub(crate) fn inject_error(&self) {
            match self.never {}
        }
    }

    pub fn connect(
        addr: &str,
        _secret: &Secret,
        _client_name: &str,
        _fence: u64,
        _device: Option<&str>,
    ) -> Result<QueuePair, VerbsError> {
        Err(VerbsError::Connect {
            peer: addr.into(),
            reason: not_built(),
        })
    }

    /// The node side (cannot exist in this build).
    pub struct RdmaNic {
        never: std::convert::Infallible,
    }

    impl RdmaNic {
        pub fn open(_device: &str, _table: &RegionTable) -> Result<RdmaNic, RdmaNicError> {
            Err(RdmaNicError::NotBuilt(not_built()))
        }
        pub fn open_with(
            _device: &str,
            _table: &RegionTable,
            _atomics: NodeAtomics,
        ) -> Result<RdmaNic, RdmaNicError> {
            Err(RdmaNicError::NotBuilt(not_built()))
        }
        pub fn describe(&self) -> String {
            match self.never {}
        }
        pub fn serve<S: std::io::Read + std::io::Write>(
            &self,
            _stream: S,
        ) -> Result<(), RdmaNicError> {
            match self.never {}
        }
    }
}

#[cfg(feature = "rdma")]
mod imp {
    use std::collections::{HashMap, VecDeque};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};
    use std::time::{Duration, Instant};

    use tracing::warn;

    use ibverbs_sys as ffi;

    use super::device::{chain_of, Device, Mr, Op, Rc};
    use super::*;
    use crate::auth::{client_handshake, Secret};
    use crate::masked::{masked_cas, masked_faa};
    use crate::qp::{Posted, QueuePair, Slot, Transport};
    use crate::region::{RegionInfo, RegionTable};
    use crate::wire::{self, ConnKind, FrameKind, RdmaAccept, RdmaEndpoint};
    use crate::wr::{Completions, Opcode, Outcome, WorkRequest, MAX_BATCH_BYTES};
    use crate::Access;

    /// Send-queue depth: at most this many work requests are outstanding on a queue pair
    /// (over all its batches); a batch is posted in chains of at most this many requests.
    pub const DEPTH: u32 = 128;
    /// How long a batch may take, from its post to its completion, before the queue pair is
    /// declared dead (unless connected with another deadline).
    pub const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);

    fn endpoint(e: &super::device::Endpoint) -> RdmaEndpoint {
        RdmaEndpoint {
            qpn: e.qpn,
            psn: e.psn,
            lid: e.lid,
            gid: e.gid,
        }
    }

    fn device_endpoint(e: &RdmaEndpoint) -> super::device::Endpoint {
        super::device::Endpoint {
            qpn: e.qpn,
            psn: e.psn,
            lid: e.lid,
            gid: e.gid,
        }
    }

    fn random_psn() -> u32 {
        let mut b = [0u8; 4];
        getrandom::getrandom(&mut b).expect("random numbers");
        u32::from_le_bytes(b) & 0xff_ffff
    }

    /// The memory node's side: one device, every region registered once.
    pub struct RdmaNic {
        dev: Arc<Device>,
        /// Per region: our key, its registration.
        mrs: Vec<(u32, Mr)>,
        /// Whether the regions' owner atomics go through loopback queue pairs.
        loopback: bool,
        // Keeps the regions mapped while registered.
        _table: Vec<Arc<crate::Region>>,
    }

    impl RdmaNic {
        /// Opens `device` and registers every region of `table` with its access rights; the
        /// node's own atomics on them go where [`NodeAtomics::Auto`] says.
        pub fn open(device: &str, table: &RegionTable) -> Result<RdmaNic, RdmaNicError> {
            Self::open_with(device, table, NodeAtomics::Auto)
        }

        /// [`RdmaNic::open`], with the node's own atomics where `atomics` says.
        pub fn open_with(
            device: &str,
            table: &RegionTable,
            atomics: NodeAtomics,
        ) -> Result<RdmaNic, RdmaNicError> {
            let dev =
                Device::open(Some(device)).map_err(|e| RdmaNicError::Device(e.to_string()))?;
            let loopback = match atomics {
                NodeAtomics::Auto => dev.atomic_cap == ATOMIC_HCA,
                NodeAtomics::Cpu => false,
                NodeAtomics::Loopback => true,
            };
            let mut mrs = Vec::new();
            let mut hooks = Vec::new();
            for r in table.regions() {
                let info = r.info();
                let mut access = ffi::ibv_access_flags(0);
                if info.access.contains(Access::READ) {
                    access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
                }
                if info.access.contains(Access::WRITE) {
                    access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
                }
                if info.access.contains(Access::ATOMIC) {
                    access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC;
                }
                // SAFETY: the region stays mapped while `_table` holds it, longer than the MR.
                let mr = unsafe { dev.register(r.as_mut_ptr(), info.len as usize, access) }
                    .map_err(|e| RdmaNicError::Register {
                        rkey: info.rkey,
                        reason: e.to_string(),
                    })?;
                if loopback && info.access.contains(Access::ATOMIC) {
                    let lb = Loopback::new(&dev, mr.addr(), mr.rkey(), info.rkey)
                        .map_err(|e| RdmaNicError::QueuePair(format!("loopback: {e}")))?;
                    hooks.push((r.clone(), Arc::new(lb)));
                }
                mrs.push((info.rkey, mr));
            }
            // Installed once every registration succeeded (none is left behind on failure).
            for (r, lb) in hooks {
                r.set_owner_atomics(Some(lb));
            }
            Ok(RdmaNic {
                dev,
                mrs,
                loopback,
                _table: table.regions().to_vec(),
            })
        }

        /// The device and how it does atomics, for logs and `rackfs status`.
        pub fn describe(&self) -> String {
            let own = if self.loopback {
                "the node's own atomics through a loopback queue pair"
            } else {
                "the node's own atomics on its CPU"
            };
            format!("{}; {own}", self.dev.atomics())
        }

        /// Serves one client (after its handshake): connects a queue pair to it, then holds it
        /// until the client closes the connection.
        pub fn serve<S: Read + Write>(&self, mut stream: S) -> Result<(), RdmaNicError> {
            let mut body = Vec::new();
            match wire::read_frame(&mut stream, &mut body)? {
                FrameKind::RdmaConnect => {}
                k => return Err(RdmaNicError::UnexpectedFrame(k)),
            }
            let mut c = wire::Cursor::new(&body, "rdma connect");
            let client = RdmaEndpoint::decode(&mut c)?;
            c.finish()?;
            let refuse = |stream: &mut S, why: String| {
                let mut b = Vec::new();
                wire::put_str(&mut b, &why);
                let _ = wire::write_frame(stream, FrameKind::Refused, &b);
                RdmaNicError::QueuePair(why)
            };
            let rc = match Rc::create(&self.dev, DEPTH) {
                Ok(rc) => rc,
                Err(e) => return Err(refuse(&mut stream, e.to_string())),
            };
            let psn = random_psn();
            let all = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC;
            if let Err(e) = rc.connect(psn, &device_endpoint(&client), all) {
                return Err(refuse(&mut stream, e.to_string()));
            }
            let accept = RdmaAccept {
                endpoint: endpoint(&rc.endpoint(psn)),
                atomics: self.describe(),
                regions: self
                    .mrs
                    .iter()
                    .map(|(key, mr)| (*key, mr.addr(), mr.rkey()))
                    .collect(),
            };
            wire::write_frame(&mut stream, FrameKind::RdmaAccept, &accept.encode())
                .and_then(|_| stream.flush())
                .map_err(crate::wire::WireError::Io)?;
            // The client never writes again: the read returns when it disconnects or dies.
            let mut buf = [0u8; 64];
            while let Ok(n) = stream.read(&mut buf) {
                if n == 0 {
                    break;
                }
            }
            drop(rc);
            Ok(())
        }
    }

    impl Drop for RdmaNic {
        fn drop(&mut self) {
            // The registrations go with this value: the owner's atomics go back to the CPU.
            if self.loopback {
                for r in &self._table {
                    r.set_owner_atomics(None);
                }
            }
        }
    }

    /// `ibv_device_attr::atomic_cap` of a device whose atomics are atomic only among its own.
    const ATOMIC_HCA: u32 = 1;
    /// How long one loopback atomic may take.
    const LOOPBACK_TIMEOUT: Duration = Duration::from_secs(5);

    /// A queue pair connected to another on the same device, through which the node's own
    /// atomics on one registered region go (see [`crate::region::OwnerAtomics`]): the device
    /// executes them as it does the clients', so they are atomic with each other. One atomic
    /// at a time (the node's QoS monitor and lock service are single threads).
    struct Loopback {
        dev: Arc<Device>,
        /// The region's registration: its address and RDMA key, and the region's own key.
        raddr: u64,
        rkey: u32,
        region: u32,
        /// `None` after a failure: the next atomic connects anew.
        link: Mutex<Option<LoopLink>>,
    }

    /// The two connected queue pairs and the registered word the old values land in. Field
    /// order is drop order: both queue pairs before the word's registration and the word.
    struct LoopLink {
        rc: Rc,
        _peer: Rc,
        mr: Mr,
        word: Box<u64>,
        next: u64,
    }

    impl Loopback {
        fn new(dev: &Arc<Device>, raddr: u64, rkey: u32, region: u32) -> Result<Loopback, String> {
            let lb = Loopback {
                dev: dev.clone(),
                raddr,
                rkey,
                region,
                link: Mutex::new(None),
            };
            // Connected now, so a device that cannot do it fails the node's start.
            *lb.link.lock().expect("loopback lock") = Some(lb.connect()?);
            Ok(lb)
        }

        fn connect(&self) -> Result<LoopLink, String> {
            let rc = Rc::create(&self.dev, 4).map_err(|e| e.to_string())?;
            let peer = Rc::create(&self.dev, 4).map_err(|e| e.to_string())?;
            let (psn, peer_psn) = (random_psn(), random_psn());
            rc.connect(psn, &peer.endpoint(peer_psn), ffi::ibv_access_flags(0))
                .map_err(|e| e.to_string())?;
            peer.connect(
                peer_psn,
                &rc.endpoint(psn),
                ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC,
            )
            .map_err(|e| e.to_string())?;
            let mut word = Box::new(0u64);
            let at: *mut u64 = &mut *word;
            // SAFETY: the word is boxed (it does not move), lives in the LoopLink next to its
            // registration, and the registration is dropped first (field order).
            let mr = unsafe { self.dev.register(at.cast(), 8, ffi::ibv_access_flags(0)) }
                .map_err(|e| e.to_string())?;
            Ok(LoopLink {
                rc,
                _peer: peer,
                mr,
                word,
                next: 1,
            })
        }

        fn lost(&self, reason: impl std::fmt::Display) -> VerbsError {
            VerbsError::ConnectionLost {
                peer: format!("{} loopback (region {:#x})", self.dev.name, self.region),
                reason: format!("{reason}; the loopback queue pair is reconnected"),
            }
        }
    }

    impl crate::region::OwnerAtomics for Loopback {
        fn cas(&self, offset: u64, compare: u64, swap: u64) -> Result<u64, VerbsError> {
            let mut guard = self.link.lock().expect("loopback lock");
            if guard.is_none() {
                *guard = Some(self.connect().map_err(|e| self.lost(e))?);
            }
            let link = guard.as_mut().expect("connected");
            let id = link.next;
            link.next += 1;
            let local: *mut u64 = &mut *link.word;
            let op = Op::Cas {
                remote: self.raddr + offset,
                rkey: self.rkey,
                compare,
                swap,
            };
            // SAFETY: the local buffer is the registered word, read only after this request's
            // completion is polled below (or the queue pair is destroyed first, on failure).
            let posted = unsafe { link.rc.post(&[(op, local as u64, 8)], link.mr.lkey(), id) };
            if let Err(e) = posted {
                *guard = None;
                return Err(self.lost(e));
            }
            let start = Instant::now();
            let mut got = Vec::new();
            let mut empty = 0;
            loop {
                got.clear();
                if let Err(e) = link.rc.poll(&mut got) {
                    *guard = None;
                    return Err(self.lost(e));
                }
                if let Some(d) = got.first() {
                    if d.status != 0 || chain_of(d.wr_id).0 != id {
                        let why = format!(
                            "{} (vendor error {:#x})",
                            status_name(d.status),
                            d.vendor_err
                        );
                        *guard = None;
                        return Err(self.lost(why));
                    }
                    // SAFETY: the CAS completed: the device wrote the word and is done with it.
                    return Ok(unsafe { std::ptr::read_volatile(local) });
                }
                if start.elapsed() > LOOPBACK_TIMEOUT {
                    *guard = None;
                    return Err(self.lost(format!("no completion within {LOOPBACK_TIMEOUT:?}")));
                }
                back_off(&mut empty);
            }
        }
    }

    /// Bytes of a queue pair's bounce buffer: the largest batch's payload plus the 8-byte
    /// alignment of each request of a full chain. Chains take consecutive spans of it in
    /// posting order (a ring) and free them as they complete, so batches small next to it
    /// pipeline and a batch of [`MAX_BATCH_BYTES`] waits for the ones before it to complete.
    const RING_BYTES: usize = MAX_BATCH_BYTES as usize + 8 * DEPTH as usize;

    /// The bounce buffer's spans in use, oldest first: chains complete in posting order, so
    /// spans are freed at the tail in the order they were taken at the head.
    struct Ring {
        head: usize,
        tail: usize,
        /// Whether the head went round to the start: the spans in use are `[tail, end)` and
        /// `[0, head)` (else `[tail, head)`).
        wrapped: bool,
        /// Chains holding a span (0: the ring is empty and restarts at 0).
        live: usize,
    }

    impl Ring {
        fn new() -> Ring {
            Ring {
                head: 0,
                tail: 0,
                wrapped: false,
                live: 0,
            }
        }

        /// A span of `n` bytes at the head, if one is free: its start and end (the tail moves
        /// to its end when its chain completes).
        fn alloc(&mut self, n: usize) -> Option<(usize, usize)> {
            if self.live == 0 {
                *self = Ring::new();
            }
            let start = if !self.wrapped {
                if self.head + n <= RING_BYTES {
                    self.head
                } else if n <= self.tail {
                    self.wrapped = true;
                    0
                } else {
                    return None;
                }
            } else if self.head + n <= self.tail {
                self.head
            } else {
                return None;
            };
            self.head = start + n;
            self.live += 1;
            Some((start, start + n))
        }

        /// The oldest span, which ends at `end`, is free again.
        fn free(&mut self, end: usize) {
            if end < self.tail {
                self.wrapped = false; // the tail went round too
            }
            self.tail = end;
            self.live -= 1;
        }
    }

    /// Whose completions a chain carries.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Owner {
        /// Part of the batch with this sequence number.
        Batch(u64),
        /// One CAS of a masked atomic's emulation in this batch: its old value is the next
        /// guess, not a completion of the batch.
        Step(u64),
    }

    /// A chain of work requests posted behind one doorbell, not yet completed.
    struct Chain {
        id: u64,
        owner: Owner,
        /// The end of its span of the bounce buffer.
        span_end: usize,
        /// Per request: its opcode and where its local data is in the bounce buffer.
        spots: Vec<(Opcode, usize, usize)>,
        /// Its batch is complete when this chain is.
        last_of_batch: bool,
    }

    /// A connected queue pair, its registered bounce buffer and what is posted on it.
    /// Field order is drop order: the queue pair goes first, then the buffer's registration,
    /// then the buffer, so nothing can still be writing into freed memory.
    struct Link {
        rc: Rc,
        mr: Mr,
        buf: Vec<u64>,
        /// Per region key: the registration's address and RDMA key on the node.
        remote: HashMap<u32, (u64, u32)>,
        _control: TcpStream,
        ring: Ring,
        /// Posted chains not yet completed, in posting order (which is completion order).
        chains: VecDeque<Chain>,
        /// Work requests posted and not yet completed: at most [`DEPTH`].
        sq_used: u32,
    }

    impl Link {
        fn base(&mut self) -> *mut u8 {
            self.buf.as_mut_ptr().cast()
        }
    }

    /// A batch posted and not yet complete: its completions so far.
    struct Pending {
        seq: u64,
        slot: Arc<Slot>,
        out: Completions,
        /// The request that failed the pre-post checks (the batch was posted up to it), with
        /// the number of requests it flushes.
        tail: Option<(VerbsError, usize)>,
    }

    impl Pending {
        fn finish(mut self) {
            if let Some((e, flushed)) = self.tail.take() {
                self.out.push(Outcome::Failed(e));
                for _ in 0..flushed {
                    self.out.push(Outcome::Failed(VerbsError::Flushed));
                }
            }
            self.slot.complete(Ok(self.out));
        }
    }

    /// Everything posting and completing touch, under one lock.
    struct State {
        /// `None` after a failure: the next post connects a new queue pair.
        link: Option<Link>,
        /// Batches posted and not yet complete, in posting order.
        batches: VecDeque<Pending>,
        next_batch: u64,
        next_chain: u64,
        /// The id of the last chain that completed.
        completed: u64,
        /// The old value of the last completed masked-atomic step.
        step: Option<u64>,
        /// Tests: the next chain's first request goes to a wrong remote key.
        fault_next: bool,
    }

    /// A client's RDMA connection to one memory node.
    ///
    /// Batches are posted under the state lock and left on the send queue; their waiters
    /// take turns polling the completion queue, as tcp's take turns reading the socket: one
    /// polls (the `poller` lock), completing every batch whose last chain completed, until its
    /// own batch is complete, then wakes another waiter to take over.
    pub struct RdmaConn {
        peer: String,
        addr: String,
        node_id: u32,
        regions: Vec<RegionInfo>,
        atomics: String,
        secret: Secret,
        client_name: String,
        fence: u64,
        device: Option<String>,
        deadline: Duration,
        state: Mutex<State>,
        poller: Mutex<()>,
    }

    fn connect_err(addr: &str, reason: impl ToString) -> VerbsError {
        VerbsError::Connect {
            peer: addr.into(),
            reason: reason.to_string(),
        }
    }

    /// Connects to the memory node at `addr` (its TCP listener) over the RDMA device `device`
    /// (the first one if `None`). A batch not complete within [`COMPLETION_TIMEOUT`] of its
    /// post fails, with every batch posted on the queue pair behind it.
    pub fn connect(
        addr: &str,
        secret: &Secret,
        client_name: &str,
        fence: u64,
        device: Option<&str>,
    ) -> Result<QueuePair, VerbsError> {
        connect_with_deadline(addr, secret, client_name, fence, device, COMPLETION_TIMEOUT)
    }

    /// [`connect`] with another bound on how long a batch may take.
    pub fn connect_with_deadline(
        addr: &str,
        secret: &Secret,
        client_name: &str,
        fence: u64,
        device: Option<&str>,
        deadline: Duration,
    ) -> Result<QueuePair, VerbsError> {
        let (link, node_id, regions, node_name, atomics) =
            dial(addr, secret, client_name, fence, device)?;
        let conn = RdmaConn {
            peer: format!("{node_name} ({addr}, rdma)"),
            addr: addr.into(),
            node_id,
            regions,
            atomics,
            secret: secret.clone(),
            client_name: client_name.into(),
            fence,
            device: device.map(String::from),
            deadline,
            state: Mutex::new(State {
                link: Some(link),
                batches: VecDeque::new(),
                next_batch: 0,
                next_chain: 1,
                completed: 0,
                step: None,
                fault_next: false,
            }),
            poller: Mutex::new(()),
        };
        Ok(QueuePair(Arc::new(Transport::Rdma(Arc::new(conn)))))
    }

    type Dialed = (Link, u32, Vec<RegionInfo>, String, String);

    fn dial(
        addr: &str,
        secret: &Secret,
        client_name: &str,
        fence: u64,
        device: Option<&str>,
    ) -> Result<Dialed, VerbsError> {
        let dev = Device::open(device).map_err(|e| connect_err(addr, e))?;
        let mut stream = crate::tcp::dial(addr)?;
        let accepted = client_handshake(
            &mut stream,
            ConnKind::Rdma,
            secret,
            client_name,
            fence,
            addr,
        )?;
        let rc = Rc::create(&dev, DEPTH).map_err(|e| connect_err(addr, e))?;
        let psn = random_psn();
        let mut body = Vec::new();
        endpoint(&rc.endpoint(psn)).encode(&mut body);
        let io = |e: std::io::Error| connect_err(addr, e);
        wire::write_frame(&mut stream, FrameKind::RdmaConnect, &body).map_err(io)?;
        stream.flush().map_err(io)?;
        let mut reply = Vec::new();
        let accept = match wire::read_frame(&mut stream, &mut reply) {
            Ok(FrameKind::RdmaAccept) => {
                RdmaAccept::decode(&reply).map_err(|e| connect_err(addr, e))?
            }
            Ok(FrameKind::Refused) => {
                let why = wire::Cursor::new(&reply, "refusal")
                    .str()
                    .unwrap_or_else(|_| "no reason given".into());
                return Err(connect_err(addr, format!("the node refused RDMA: {why}")));
            }
            Ok(k) => return Err(connect_err(addr, format!("unexpected {k:?} frame"))),
            Err(e) => return Err(connect_err(addr, e)),
        };
        // Our memory is never a target: no remote access.
        rc.connect(
            psn,
            &device_endpoint(&accept.endpoint),
            ffi::ibv_access_flags(0),
        )
        .map_err(|e| connect_err(addr, e))?;
        let words = RING_BYTES / 8;
        let mut buf = vec![0u64; words];
        // SAFETY: the buffer lives in the Link next to its registration, is never resized,
        // and the registration is dropped first (field order) or with it.
        let mr =
            unsafe { dev.register(buf.as_mut_ptr().cast(), words * 8, ffi::ibv_access_flags(0)) }
                .map_err(|e| connect_err(addr, e))?;
        let remote = accept
            .regions
            .iter()
            .map(|&(key, a, rkey)| (key, (a, rkey)))
            .collect();
        let link = Link {
            rc,
            mr,
            buf,
            remote,
            _control: stream,
            ring: Ring::new(),
            chains: VecDeque::new(),
            sq_used: 0,
        };
        Ok((
            link,
            accepted.welcome.node_id,
            accepted.welcome.regions,
            accepted.node_name,
            accept.atomics,
        ))
    }

    fn lost(peer: &str, reason: impl ToString) -> VerbsError {
        VerbsError::ConnectionLost {
            peer: peer.into(),
            reason: reason.to_string(),
        }
    }

    /// Pauses between empty polls of a completion queue: busy at first (a completion is
    /// microseconds away on hardware), then yielding, then sleeping with growing pauses of at
    /// most 1 ms (software devices take much longer).
    fn back_off(empty: &mut u32) {
        *empty += 1;
        if *empty > 2000 {
            std::thread::sleep(Duration::from_micros(((*empty - 2000) as u64).min(1000)));
        } else if *empty > 200 {
            std::thread::yield_now();
        }
    }

    /// Bytes of the bounce buffer a request needs (8-byte aligned).
    fn local_len(wr: &WorkRequest<'_>) -> usize {
        let len = match wr {
            WorkRequest::Read { len, .. } => *len as usize,
            WorkRequest::Write { data, .. } => data.len(),
            _ => 8,
        };
        len.next_multiple_of(8)
    }

    impl RdmaConn {
        pub(crate) fn regions(&self) -> &[RegionInfo] {
            &self.regions
        }
        pub(crate) fn node_id(&self) -> u32 {
            self.node_id
        }
        pub(crate) fn peer(&self) -> &str {
            &self.peer
        }
        /// The device's atomics and how masked atomics are done.
        pub fn atomics(&self) -> &str {
            &self.atomics
        }

        fn state(&self) -> std::sync::MutexGuard<'_, State> {
            self.state.lock().expect("rdma state lock")
        }

        /// Puts the queue pair into the error state, as a fatal transport error would (tests).
        pub(crate) fn inject_error(&self) {
            if let Some(link) = self.state().link.as_ref() {
                link.rc
                    .fail()
                    .expect("move the queue pair to the error state");
            }
        }

        /// Sends the next posted chain's first request to a remote key the node does not
        /// have, so the node's NIC answers it with a remote access error (tests).
        pub(crate) fn inject_remote_fault(&self) {
            self.state().fault_next = true;
        }

        fn check(&self, wr: &WorkRequest<'_>) -> Result<(), VerbsError> {
            let a = wr.addr();
            match self.regions.iter().find(|r| r.rkey == a.rkey) {
                Some(r) => r.check(wr.opcode(), a.offset, wr.len()),
                None => Err(VerbsError::BadKey { rkey: a.rkey }),
            }
        }

        /// Posts the batch's requests on the send queue and returns at once (waiting only for
        /// room on the send queue or in the bounce buffer), except for masked atomics: each is
        /// a CAS loop whose steps are waited for here, since nothing posted after it may run
        /// before it.
        pub(crate) fn post(self: &Arc<Self>, batch: &Batch<'_>) -> Posted {
            let deadline = Instant::now() + self.deadline;
            let reqs = batch.requests();
            let bad = reqs
                .iter()
                .enumerate()
                .find_map(|(i, wr)| self.check(wr).err().map(|e| (i, e)));
            let upto = bad.as_ref().map_or(reqs.len(), |b| b.0);
            let slot = Arc::new(Slot::default());
            let pending = |seq| Pending {
                seq,
                slot: slot.clone(),
                out: Completions::with_capacity(reqs.len(), batch.read_bytes() as usize),
                tail: bad.clone().map(|(i, e)| (e, reqs.len() - i - 1)),
            };
            if upto == 0 {
                // Nothing to post: an empty batch, or its first request is refused.
                pending(0).finish();
                return Posted::rdma(slot, self.clone(), deadline);
            }
            let mut st = self.state();
            if st.link.is_none() {
                match dial(
                    &self.addr,
                    &self.secret,
                    &self.client_name,
                    self.fence,
                    self.device.as_deref(),
                ) {
                    Ok((link, ..)) => st.link = Some(link),
                    Err(e) => return Posted::ready(Err(e)),
                }
            }
            let seq = st.next_batch;
            st.next_batch += 1;
            st.batches.push_back(pending(seq));
            let mut i = 0;
            while i < upto {
                let end = reqs[i..upto]
                    .iter()
                    .position(is_masked)
                    .map_or(upto, |p| i + p);
                if end == i {
                    let Some(old) = self.emulate_masked(&mut st, seq, &reqs[i], deadline) else {
                        break; // the queue pair failed, and the batch with it
                    };
                    let front = st.batches.front_mut().expect("the masked batch is pending");
                    debug_assert_eq!(front.seq, seq, "everything before it completed");
                    front.out.push(Outcome::Value(old));
                    i += 1;
                    if i == upto {
                        st.batches.pop_front().expect("pending").finish();
                    }
                    continue;
                }
                let mut ok = true;
                for (k, chunk) in reqs[i..end].chunks(DEPTH as usize).enumerate() {
                    let last = end == upto && i + (k + 1) * DEPTH as usize >= end;
                    if self
                        .post_chain(&mut st, Owner::Batch(seq), chunk, last, deadline)
                        .is_none()
                    {
                        ok = false;
                        break;
                    }
                }
                if !ok {
                    break;
                }
                i = end;
            }
            drop(st);
            Posted::rdma(slot, self.clone(), deadline)
        }

        /// Posts `reqs` (no masked atomics, at most [`DEPTH`]) as one chain, once the send
        /// queue and the bounce buffer have room; returns its id, or `None` if the queue pair
        /// failed (every pending batch is then complete with an error).
        fn post_chain(
            &self,
            st: &mut State,
            owner: Owner,
            reqs: &[WorkRequest<'_>],
            last_of_batch: bool,
            deadline: Instant,
        ) -> Option<u64> {
            let bytes: usize = reqs.iter().map(local_len).sum();
            let mut empty = 0;
            let (start, span_end) = loop {
                let link = st.link.as_mut()?;
                if link.sq_used + reqs.len() as u32 <= DEPTH {
                    if let Some(span) = link.ring.alloc(bytes) {
                        break span;
                    }
                }
                // Make room: complete what has completed (and wake its waiters).
                self.drive(st);
                if Instant::now() > deadline {
                    self.timed_out(st, " (the send queue or the bounce buffer stayed full)");
                    return None;
                }
                back_off(&mut empty);
            };
            let id = st.next_chain;
            st.next_chain += 1;
            let fault = std::mem::take(&mut st.fault_next);
            let link = st.link.as_mut().expect("checked above");
            let base = link.base();
            let mut ops = Vec::with_capacity(reqs.len());
            let mut spots = Vec::with_capacity(reqs.len());
            let mut at = start;
            for (k, wr) in reqs.iter().enumerate() {
                let a = wr.addr();
                let Some(&(raddr, mut rkey)) = link.remote.get(&a.rkey) else {
                    // Checked against the regions before: the node's answer lacked one. The
                    // batches already complete keep their results; the queue pair (and its
                    // ring, this chain's span with it) goes.
                    self.drive(st);
                    self.fail_all(
                        st,
                        None,
                        format!("region {:#x} not registered for RDMA by the node", a.rkey),
                    );
                    return None;
                };
                if fault && k == 0 {
                    rkey ^= 0x00a5_5a00;
                }
                let remote = raddr + a.offset;
                let (op, len) = match wr {
                    WorkRequest::Read { len, .. } => (Op::Read { remote, rkey }, *len as usize),
                    WorkRequest::Write { data, .. } => {
                        // SAFETY: `[at, at + len)` is inside this chain's span of the bounce
                        // buffer, which nothing else uses (the NIC included) until the chain
                        // completes; the source is the caller's slice, not the buffer.
                        unsafe {
                            std::ptr::copy_nonoverlapping(data.as_ptr(), base.add(at), data.len())
                        };
                        (Op::Write { remote, rkey }, data.len())
                    }
                    WorkRequest::Cas { compare, swap, .. } => (
                        Op::Cas {
                            remote,
                            rkey,
                            compare: *compare,
                            swap: *swap,
                        },
                        8,
                    ),
                    WorkRequest::Faa { add, .. } => (
                        Op::Faa {
                            remote,
                            rkey,
                            add: *add,
                        },
                        8,
                    ),
                    WorkRequest::MaskedCas { .. } | WorkRequest::MaskedFaa { .. } => {
                        unreachable!("masked atomics are emulated")
                    }
                };
                ops.push((op, base as u64 + at as u64, len as u32));
                spots.push((wr.opcode(), at, len));
                at += local_len(wr);
            }
            let lkey = link.mr.lkey();
            // SAFETY: every local buffer is inside this chain's span of `link.buf`, registered
            // as `link.mr`; the ring never hands out a span overlapping a live chain's, and frees
            // one only when its chain's completion is polled (`complete_chain`), so neither the
            // NIC nor another chain touches it meanwhile; the link's fields drop the queue pair
            // before the buffer and its registration.
            let posted = unsafe { link.rc.post(&ops, lkey, id) };
            if let Err(e) = posted {
                // As above: what completed keeps its result, the rest fails.
                self.drive(st);
                self.fail_all(st, None, format!("{e}; the queue pair is reconnected"));
                return None;
            }
            link.sq_used += ops.len() as u32;
            link.chains.push_back(Chain {
                id,
                owner,
                span_end,
                spots,
                last_of_batch,
            });
            Some(id)
        }

        /// Polls the completion queue until it is empty, completing chains and the batches
        /// they finish. An error completion fails the queue pair (see [`Self::fail_all`]).
        fn drive(&self, st: &mut State) {
            let mut got = Vec::new();
            loop {
                let Some(link) = st.link.as_mut() else {
                    return;
                };
                got.clear();
                if let Err(e) = link.rc.poll(&mut got) {
                    self.fail_all(st, None, format!("{e}; the queue pair is reconnected"));
                    return;
                }
                if got.is_empty() {
                    return;
                }
                for d in &got {
                    let (chain, index) = chain_of(d.wr_id);
                    if d.status != 0 {
                        let why = format!(
                            "work request {index} of chain {chain} failed: {} (vendor error \
                             {:#x}); the queue pair is reconnected",
                            status_name(d.status),
                            d.vendor_err
                        );
                        self.fail_all(st, Some(chain), why);
                        return;
                    }
                    let link = st.link.as_mut().expect("still connected");
                    let front = link.chains.pop_front();
                    let Some(c) = front.filter(|c| c.id == chain) else {
                        self.fail_all(
                            st,
                            None,
                            format!(
                                "completion of chain {chain} out of posting order; the queue \
                                 pair is reconnected"
                            ),
                        );
                        return;
                    };
                    self.complete_chain(st, c);
                }
            }
        }

        /// Takes a completed chain's results out of the bounce buffer, frees its span, and
        /// completes its batch if it was the batch's last chain.
        fn complete_chain(&self, st: &mut State, c: Chain) {
            let link = st.link.as_mut().expect("connected");
            let base = link.base();
            link.sq_used -= c.spots.len() as u32;
            st.completed = c.id;
            let read = |at: usize, len: usize| {
                // SAFETY: the chain's completion was polled: the NIC wrote its span (in the
                // registered buffer) and touches it no more; nothing else writes it until it
                // is freed below.
                unsafe { std::slice::from_raw_parts(base.add(at).cast_const(), len) }
            };
            match c.owner {
                Owner::Step(_) => {
                    let (_, at, _) = c.spots[0];
                    st.step = Some(u64::from_ne_bytes(read(at, 8).try_into().expect("8")));
                }
                Owner::Batch(seq) => {
                    let p = st.batches.front_mut().expect("a chain's batch is pending");
                    debug_assert_eq!(p.seq, seq, "chains complete in posting order");
                    for &(op, at, len) in &c.spots {
                        match op {
                            Opcode::Read => {
                                let start = p.out.data.len();
                                p.out.data.extend_from_slice(read(at, len));
                                p.out.push(Outcome::Data { start, len });
                            }
                            Opcode::Write => p.out.push(Outcome::Written),
                            _ => p.out.push(Outcome::Value(u64::from_ne_bytes(
                                read(at, 8).try_into().expect("8 bytes"),
                            ))),
                        }
                    }
                }
            }
            st.link.as_mut().expect("connected").ring.free(c.span_end);
            if c.last_of_batch {
                st.batches.pop_front().expect("pending").finish();
            }
        }

        /// A deadline passed with requests still posted: the queue pair fails (`detail` says
        /// what was waited for) and is reconnected.
        fn timed_out(&self, st: &mut State, detail: &str) {
            let why = format!(
                "no completion within {:?}{detail}; the queue pair is reconnected",
                self.deadline
            );
            self.fail_all(st, None, why);
        }

        /// The queue pair failed (an error completion of chain `failed`, or `None`: no
        /// completion in time, a failed post or poll): it is destroyed, and a new one is
        /// connected on the next post. The batch of the failed chain fails with `why`; the
        /// batches posted behind it fail as flushed (their requests may or may not have run:
        /// a lost acknowledgement looks the same as a lost request); the batches completed
        /// before it keep their results.
        fn fail_all(&self, st: &mut State, failed: Option<u64>, why: String) {
            let owner = failed.and_then(|id| {
                st.link
                    .as_ref()
                    .and_then(|l| l.chains.iter().find(|c| c.id == id))
                    .map(|c| match c.owner {
                        Owner::Batch(s) | Owner::Step(s) => s,
                    })
            });
            // Destroys the queue pair before the buffer it may still be writing into.
            st.link = None;
            let n = st.batches.len();
            for p in st.batches.drain(..) {
                let reason = match owner {
                    Some(s) if s != p.seq => format!(
                        "flushed: posted behind batch {s}, whose request failed on the same \
                         queue pair (this batch's outcome is unknown); the queue pair is \
                         reconnected"
                    ),
                    _ => why.clone(),
                };
                p.slot.complete(Err(lost(&self.peer, reason)));
            }
            st.step = None;
            warn!(peer = %self.peer, batches = n, reason = %why, "rdma queue pair failed");
        }

        /// Polls until chain `id` completes (true), or the queue pair fails or `deadline`
        /// passes (false: every pending batch is then complete with an error).
        fn drive_until(&self, st: &mut State, id: u64, deadline: Instant) -> bool {
            let mut empty = 0;
            loop {
                self.drive(st);
                if st.link.is_none() {
                    return false;
                }
                if st.completed >= id {
                    return true;
                }
                if Instant::now() > deadline {
                    self.timed_out(st, "");
                    return false;
                }
                back_off(&mut empty);
            }
        }

        /// Drives the queue pair until `slot` completes (see [`RdmaConn`]), at most until
        /// `deadline`: then the queue pair is declared dead and fails.
        pub(crate) fn poll_slot(
            &self,
            slot: &Slot,
            deadline: Instant,
            cx: &mut Context<'_>,
        ) -> Poll<Result<Completions, VerbsError>> {
            let mut registered = false;
            let mut was_poller = false;
            loop {
                if let Some(r) = slot.take() {
                    if was_poller {
                        self.hand_over();
                    }
                    return Poll::Ready(r);
                }
                match self.poller.try_lock() {
                    Ok(_poller) => {
                        was_poller = true;
                        if slot.is_done() {
                            continue; // completed by the previous poller: release the lock first
                        }
                        self.pump(slot, deadline);
                    }
                    Err(_) if !registered => {
                        // Register, then try the lock once more: either we get it, or its
                        // holder releases it after our waker is visible to `hand_over`.
                        slot.set_waker(cx.waker());
                        registered = true;
                    }
                    Err(_) => return Poll::Pending,
                }
            }
        }

        fn pump(&self, slot: &Slot, deadline: Instant) {
            let mut empty = 0;
            loop {
                {
                    let mut st = self.state();
                    self.drive(&mut st);
                    if slot.is_done() {
                        return;
                    }
                    if Instant::now() > deadline {
                        self.timed_out(&mut st, "");
                        if !slot.is_done() {
                            slot.complete(Err(lost(&self.peer, "no completion in time")));
                        }
                        return;
                    }
                }
                back_off(&mut empty);
            }
        }

        /// Wakes one waiting poster so the queue pair keeps a poller while batches are pending.
        fn hand_over(&self) {
            let st = self.state();
            for p in st.batches.iter() {
                if p.slot.wake_waiter() {
                    return;
                }
            }
        }

        /// A masked atomic as a CAS loop: guess the word, CAS it to the masked result of the
        /// guess; a failed CAS returns the real word, which is the next guess. Each step is
        /// posted behind everything posted before it and waited for. `None` if the queue pair
        /// failed.
        fn emulate_masked(
            &self,
            st: &mut State,
            seq: u64,
            wr: &WorkRequest<'_>,
            deadline: Instant,
        ) -> Option<u64> {
            let apply = |old: u64| match wr {
                WorkRequest::MaskedCas {
                    compare,
                    compare_mask,
                    swap,
                    swap_mask,
                    ..
                } => masked_cas(old, *compare, *compare_mask, *swap, *swap_mask),
                WorkRequest::MaskedFaa { add, boundary, .. } => masked_faa(old, *add, *boundary),
                _ => unreachable!("only masked atomics are emulated"),
            };
            let addr = wr.addr();
            let mut guess = 0u64;
            loop {
                let cas = [WorkRequest::Cas {
                    addr,
                    compare: guess,
                    swap: apply(guess),
                }];
                let id = self.post_chain(st, Owner::Step(seq), &cas, false, deadline)?;
                if !self.drive_until(st, id, deadline) {
                    return None;
                }
                let old = st.step.take()?;
                if old == guess {
                    return Some(old);
                }
                guess = old;
            }
        }
    }

    fn is_masked(wr: &WorkRequest<'_>) -> bool {
        matches!(wr.opcode(), Opcode::MaskedCas | Opcode::MaskedFaa)
    }

    fn status_name(status: u32) -> String {
        // SAFETY: ibv_wc_status_str returns a static C string for any status value.
        let s = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_wc_status_str(status)) };
        format!("{} (status {status})", s.to_string_lossy())
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Spans taken and freed in FIFO order (as chains complete) never overlap one in
            /// use, stay inside the buffer, and an empty ring always has room for the largest.
            #[test]
            fn ring_spans_never_overlap(steps in proptest::collection::vec((any::<bool>(), 0usize..6), 1..400)) {
                let sizes = [0, 8, 4096, 1 << 20, 5 << 20, RING_BYTES];
                let mut ring = Ring::new();
                let mut live: VecDeque<(usize, usize)> = VecDeque::new();
                for (take, size) in steps {
                    if take || live.is_empty() {
                        let n = sizes[size];
                        match ring.alloc(n) {
                            Some((start, end)) => {
                                prop_assert_eq!(end - start, n);
                                prop_assert!(end <= RING_BYTES);
                                for &(s, e) in &live {
                                    prop_assert!(end <= s || e <= start || n == 0 || s == e,
                                        "[{start}, {end}) overlaps [{s}, {e})");
                                }
                                live.push_back((start, end));
                            }
                            None => prop_assert!(!live.is_empty(), "an empty ring refused {n}"),
                        }
                    } else {
                        let (_, end) = live.pop_front().unwrap();
                        ring.free(end);
                    }
                }
                while let Some((_, end)) = live.pop_front() {
                    ring.free(end);
                }
                prop_assert_eq!(ring.alloc(RING_BYTES), Some((0, RING_BYTES)));
            }
        }
    }
}
