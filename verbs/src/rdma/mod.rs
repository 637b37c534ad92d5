//! The `rdma` transport: reliable-connected queue pairs on an RDMA device (feature `rdma`).
//!
//! **Set-up** goes over the node's TCP listener: the client authenticates as for every
//! connection (kind `Rdma`), sends its queue pair's endpoint (QP number, PSN, LID, GID), and
//! the node answers with its own queue pair's endpoint and, per region, the registration's
//! address and RDMA key. The TCP connection then stays open and idle: its end tells the node
//! to destroy the queue pair (and is how a dead client is noticed), as with shm.
//!
//! **Data path**: the node's CPU takes no part. A batch becomes chains of work requests posted
//! behind one doorbell each, only the last signalled; the client polls its completion queue
//! (busy at first, then yielding, then sleeping with growing pauses). READ results and atomic
//! old values land in a registered bounce buffer; WRITE data is copied into it first. Masked
//! atomics, which plain RDMA devices do not have, are emulated with CAS loops that start from
//! a guess and learn the word from each failed CAS (every step is one atomic, so the result is
//! atomic against every other atomic on the region); a chain is split around them.
//!
//! **Errors**: each request is checked against the region's key, access, bounds and alignment
//! before posting, so a bad request fails alone with the same specific error as on tcp and
//! shm and the rest of its batch is flushed. A work completion in error (the queue pair is
//! then in the error state) fails the batch with a clear message; the queue pair is torn
//! down and a new one is connected on the next post.
//!
//! One queue pair carries one batch at a time (a mutex): pipelining across threads would need
//! a queue pair per thread. Verbs on this transport are not seen by the node's counters.

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
        pub(crate) fn post(&self, _: &Batch<'_>) -> Posted {
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
    use std::collections::HashMap;
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use ibverbs_sys as ffi;

    use super::device::{Device, Done, Mr, Op, Rc};
    use super::*;
    use crate::auth::{client_handshake, Secret};
    use crate::masked::{masked_cas, masked_faa};
    use crate::qp::{Posted, QueuePair, Transport};
    use crate::region::{RegionInfo, RegionTable};
    use crate::wire::{self, ConnKind, FrameKind, RdmaAccept, RdmaEndpoint};
    use crate::wr::{Completions, Opcode, Outcome, WorkRequest, MAX_BATCH_BYTES};
    use crate::Access;

    /// Send-queue depth: a batch is posted in chains of at most this many requests.
    const DEPTH: u32 = 128;
    /// How long a chain may take before the queue pair is declared dead.
    const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);

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
        // Keeps the regions mapped while registered.
        _table: Vec<Arc<crate::Region>>,
    }

    impl RdmaNic {
        /// Opens `device` and registers every region of `table` with its access rights.
        pub fn open(device: &str, table: &RegionTable) -> Result<RdmaNic, RdmaNicError> {
            let dev =
                Device::open(Some(device)).map_err(|e| RdmaNicError::Device(e.to_string()))?;
            let mut mrs = Vec::new();
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
                mrs.push((info.rkey, mr));
            }
            Ok(RdmaNic {
                dev,
                mrs,
                _table: table.regions().to_vec(),
            })
        }

        /// The device and how it does atomics, for logs and `rackfs status`.
        pub fn describe(&self) -> String {
            self.dev.atomics()
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

    /// A connected queue pair and its registered bounce buffer.
    /// Field order is drop order: the queue pair goes first, then the buffer's registration,
    /// then the buffer, so nothing can still be writing into freed memory.
    struct Link {
        rc: Rc,
        mr: Mr,
        buf: Vec<u64>,
        /// Per region key: the registration's address and RDMA key on the node.
        remote: HashMap<u32, (u64, u32)>,
        _control: TcpStream,
    }

    /// A client's RDMA connection to one memory node.
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
        /// `None` after a failure: the next post connects a new queue pair.
        link: Mutex<Option<Link>>,
    }

    fn connect_err(addr: &str, reason: impl ToString) -> VerbsError {
        VerbsError::Connect {
            peer: addr.into(),
            reason: reason.to_string(),
        }
    }

    /// Connects to the memory node at `addr` (its TCP listener) over the RDMA device `device`
    /// (the first one if `None`).
    pub fn connect(
        addr: &str,
        secret: &Secret,
        client_name: &str,
        fence: u64,
        device: Option<&str>,
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
            link: Mutex::new(Some(link)),
        };
        Ok(QueuePair(Arc::new(Transport::Rdma(Box::new(conn)))))
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
        let words = (MAX_BATCH_BYTES as usize + 8 * DEPTH as usize) / 8;
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

        pub(crate) fn post(&self, batch: &Batch<'_>) -> Posted {
            Posted::ready(self.execute(batch))
        }

        /// Puts the queue pair into the error state, as a fatal transport error would (tests).
        pub(crate) fn inject_error(&self) {
            if let Some(link) = self.link.lock().expect("rdma link lock").as_ref() {
                link.rc
                    .fail()
                    .expect("move the queue pair to the error state");
            }
        }

        fn check(&self, wr: &WorkRequest<'_>) -> Result<(), VerbsError> {
            let a = wr.addr();
            match self.regions.iter().find(|r| r.rkey == a.rkey) {
                Some(r) => r.check(wr.opcode(), a.offset, wr.len()),
                None => Err(VerbsError::BadKey { rkey: a.rkey }),
            }
        }

        fn execute(&self, batch: &Batch<'_>) -> Result<Completions, VerbsError> {
            let reqs = batch.requests();
            let mut out = Completions::with_capacity(reqs.len(), batch.read_bytes() as usize);
            let bad = reqs
                .iter()
                .enumerate()
                .find_map(|(i, wr)| self.check(wr).err().map(|e| (i, e)));
            let upto = bad.as_ref().map_or(reqs.len(), |b| b.0);
            let mut guard = self.link.lock().expect("rdma link lock");
            if guard.is_none() {
                let (link, ..) = dial(
                    &self.addr,
                    &self.secret,
                    &self.client_name,
                    self.fence,
                    self.device.as_deref(),
                )?;
                *guard = Some(link);
            }
            let link = guard.as_mut().expect("connected");
            let result = (|| {
                let mut i = 0;
                while i < upto {
                    let end = reqs[i..upto]
                        .iter()
                        .position(|w| is_masked(w))
                        .map_or(upto, |p| i + p);
                    if end == i {
                        let v = self.emulate_masked(link, &reqs[i])?;
                        out.push(Outcome::Value(v));
                        i += 1;
                        continue;
                    }
                    for chunk in reqs[i..end].chunks(DEPTH as usize) {
                        self.run_chain(link, chunk, &mut out)?;
                    }
                    i = end;
                }
                Ok(())
            })();
            if let Err(e) = result {
                // The queue pair may be in the error state: tear it down, connect anew next time.
                *guard = None;
                return Err(e);
            }
            if let Some((_, e)) = bad {
                out.push(Outcome::Failed(e));
                for _ in upto + 1..reqs.len() {
                    out.push(Outcome::Failed(VerbsError::Flushed));
                }
            }
            Ok(out)
        }

        /// Posts `reqs` (no masked atomics) as one signalled chain and waits for it.
        fn run_chain(
            &self,
            link: &mut Link,
            reqs: &[WorkRequest<'_>],
            out: &mut Completions,
        ) -> Result<(), VerbsError> {
            let base = link.buf.as_mut_ptr() as u64;
            let bytes: &mut [u8] = {
                let len = link.buf.len() * 8;
                // SAFETY: the u64 buffer viewed as bytes (same memory, same lifetime, no
                // other reference to it while this one lives; the NIC only touches it
                // between post and completion, both inside this function).
                unsafe { std::slice::from_raw_parts_mut(link.buf.as_mut_ptr().cast(), len) }
            };
            let mut ops = Vec::with_capacity(reqs.len());
            let mut at = 0usize;
            let mut spots = Vec::with_capacity(reqs.len());
            for wr in reqs {
                let a = wr.addr();
                let &(raddr, rkey) = link.remote.get(&a.rkey).ok_or_else(|| {
                    lost(
                        &self.peer,
                        format!("region {:#x} not registered for RDMA", a.rkey),
                    )
                })?;
                let remote = raddr + a.offset;
                let (op, len) = match wr {
                    WorkRequest::Read { len, .. } => (Op::Read { remote, rkey }, *len as usize),
                    WorkRequest::Write { data, .. } => {
                        bytes[at..at + data.len()].copy_from_slice(data);
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
                ops.push((op, base + at as u64, len as u32));
                spots.push((at, len));
                at = (at + len).next_multiple_of(8);
            }
            // SAFETY: every local buffer is inside `link.buf`, registered as `link.mr`, and
            // untouched until the chain's completion is polled below (or the link is dropped,
            // with its queue pair first, on failure).
            unsafe { link.rc.post(&ops, link.mr.lkey()) }.map_err(|e| lost(&self.peer, e))?;
            let last = ops.len() as u64 - 1;
            let done = self.wait(&link.rc, last)?;
            if done.status != 0 {
                return Err(lost(
                    &self.peer,
                    format!(
                        "work request {} of the chain failed: {} (vendor error {:#x}); the queue \
                         pair is reconnected",
                        done.wr_id,
                        status_name(done.status),
                        done.vendor_err
                    ),
                ));
            }
            for (wr, (at, len)) in reqs.iter().zip(spots) {
                match wr.opcode() {
                    Opcode::Read => {
                        let start = out.data.len();
                        out.data.extend_from_slice(&bytes[at..at + len]);
                        out.push(Outcome::Data { start, len });
                    }
                    Opcode::Write => out.push(Outcome::Written),
                    _ => out.push(Outcome::Value(u64::from_ne_bytes(
                        bytes[at..at + 8].try_into().expect("8 bytes"),
                    ))),
                }
            }
            Ok(())
        }

        /// Polls until the completion of request `last`, or the first error completion.
        fn wait(&self, rc: &Rc, last: u64) -> Result<Done, VerbsError> {
            let start = Instant::now();
            let mut got = Vec::new();
            let mut empty = 0u32;
            loop {
                rc.poll(&mut got).map_err(|e| lost(&self.peer, e))?;
                if let Some(d) = got.iter().find(|d| d.status != 0 || d.wr_id == last) {
                    return Ok(*d);
                }
                got.clear();
                empty += 1;
                // Busy-poll first (a completion is microseconds away on hardware), then yield,
                // then sleep with growing pauses (software devices take much longer).
                if empty > 2000 {
                    std::thread::sleep(Duration::from_micros(((empty - 2000) as u64).min(1000)));
                } else if empty > 200 {
                    std::thread::yield_now();
                }
                if start.elapsed() > COMPLETION_TIMEOUT {
                    return Err(lost(
                        &self.peer,
                        format!("no completion in {COMPLETION_TIMEOUT:?}; the queue pair is reconnected"),
                    ));
                }
            }
        }

        /// A masked atomic as a CAS loop: guess the word, CAS it to the masked result of the
        /// guess; a failed CAS returns the real word, which is the next guess.
        fn emulate_masked(&self, link: &mut Link, wr: &WorkRequest<'_>) -> Result<u64, VerbsError> {
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
                let mut out = Completions::with_capacity(1, 0);
                self.run_chain(link, &cas, &mut out)?;
                let old = out.value(crate::WrId(0))?;
                if old == guess {
                    return Ok(old);
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
}
