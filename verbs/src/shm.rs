//! The `shm` transport: a colocated memory node's regions mapped into the client.
//!
//! The client connects to the node's Unix socket, authenticates, and receives the regions'
//! memfds (SCM_RIGHTS) plus a counter block of its own. Verbs are then CPU copies and atomics on
//! the shared mapping, executed synchronously in `post` (so batches trivially run in order). The
//! Unix connection stays open only as a liveness signal in both directions: when it closes the
//! node knows the client is gone, and the client knows the node is — from then on its queue
//! pair fails every batch with `ConnectionLost`, although the mapping would still work: the
//! memory of a dead node is no longer part of the cluster, and nobody else can see it. Atomics are CPU atomics on the same physical memory the node's NIC threads
//! use, so `shm` and `tcp` clients of one node are atomic with respect to each other.
//!
//! ## Fencing
//! A node cannot take a mapping back, so an shm client fences itself, checked by the node:
//! two words of the client's counter block: [`FENCE_WORD`], set once by the node (nobody else
//! writes it), and [`BUSY_WORD`], the client's batches in progress (only the client changes it). A
//! batch increments `busy`, then reads `fence`, and runs only if it reads 0; the node stores
//! `fence`, then reads `busy` (all sequentially consistent). So once the node has read
//! `busy == 0` after its store, no batch of the client runs again (one that raced the store
//! saw it, or was counted in `busy`). A client stopped *inside* a batch keeps `busy` up: the
//! node cannot fence it and must stop the process ([`fence_client`] says which happened).
//!
//! The node's own lease to serve data ([`crate::lease`]) is a third word, [`LEASE_WORD`],
//! written only by the node (at connect and on every renewal); a batch runs only while it
//! holds, checked after `busy` is raised like the fence.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use sendfd::{RecvWithFd, SendWithFd};

use crate::auth::{client_handshake, Secret};
use crate::counters::{VerbCounters, COUNTER_BLOCK_LEN};
use crate::qp::{QueuePair, Transport};
use crate::region::{Region, RegionInfo, RegionTable};
use crate::wire::{self, ConnKind, Cursor, FrameKind, WireError};
use crate::wr::{Access, Batch, Completions};
use crate::VerbsError;

const MAX_FDS: usize = 16;

/// Offset in an shm client's counter block of the fence word (see the module docs).
pub const FENCE_WORD: u64 = 2048;
/// Offset in an shm client's counter block of its batches in progress.
pub const BUSY_WORD: u64 = 2056;
/// Offset in an shm client's counter block of the node's lease to serve data: until when, on
/// `CLOCK_MONOTONIC` (written only by the node; see [`crate::lease`]).
pub const LEASE_WORD: u64 = 2064;

pub(crate) struct ShmQp {
    table: RegionTable,
    infos: Vec<RegionInfo>,
    counters: VerbCounters,
    node_id: u32,
    peer: String,
    /// Set by the watcher thread when the node closes the liveness connection.
    node_gone: Arc<AtomicBool>,
    liveness: UnixStream,
}

impl Drop for ShmQp {
    fn drop(&mut self) {
        // Wakes the watcher thread (its read returns) so it exits.
        let _ = self.liveness.shutdown(std::net::Shutdown::Both);
    }
}

impl ShmQp {
    pub(crate) fn execute(&self, batch: &Batch<'_>) -> Result<Completions, VerbsError> {
        if self.node_gone.load(Ordering::Acquire) {
            return Err(VerbsError::ConnectionLost {
                peer: self.peer.clone(),
                reason: "the memory node closed its shm connection (it stopped or died)".into(),
            });
        }
        let block = self.counters.region();
        let busy = block.shared_word(BUSY_WORD);
        busy.fetch_add(1, Ordering::SeqCst);
        if self.is_fenced() {
            busy.fetch_sub(1, Ordering::SeqCst);
            return Err(VerbsError::Fenced {
                peer: self.peer.clone(),
                reason: "the mount's lease expired; its batches are refused".into(),
            });
        }
        let lease = block.shared_word(LEASE_WORD).load(Ordering::SeqCst);
        if !crate::lease::valid_until(lease) {
            busy.fetch_sub(1, Ordering::SeqCst);
            return Err(VerbsError::ConnectionLost {
                peer: self.peer.clone(),
                reason: "the memory node's lease from the primary lapsed (it may be stopped, \
                         or declared dead and its data copied elsewhere): its memory is not \
                         read or written"
                    .into(),
            });
        }
        let mut done = Completions::with_capacity(batch.len(), batch.read_bytes() as usize);
        self.table
            .execute_batch(batch.requests(), &mut done, |_, _| {});
        busy.fetch_sub(1, Ordering::SeqCst);
        self.counters.record_batch(batch, &done);
        Ok(done)
    }
    pub(crate) fn is_fenced(&self) -> bool {
        self.counters
            .region()
            .shared_word(FENCE_WORD)
            .load(Ordering::SeqCst)
            != 0
    }
    pub(crate) fn regions(&self) -> &[RegionInfo] {
        &self.infos
    }
    pub(crate) fn node_id(&self) -> u32 {
        self.node_id
    }
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }
}

/// Connects to a memory node's Unix socket and maps its regions.
pub fn connect(socket: &Path, secret: &Secret, client_name: &str) -> Result<QueuePair, VerbsError> {
    connect_fenced(socket, secret, client_name, 0)
}

/// [`connect`] under fence token `fence` (see [`crate::wire::Hello::fence`]).
pub fn connect_fenced(
    socket: &Path,
    secret: &Secret,
    client_name: &str,
    fence: u64,
) -> Result<QueuePair, VerbsError> {
    let peer = format!("unix:{}", socket.display());
    let mut stream = UnixStream::connect(socket).map_err(|e| VerbsError::Connect {
        peer: peer.clone(),
        reason: e.to_string(),
    })?;
    let accepted = client_handshake(
        &mut stream,
        ConnKind::Shm,
        secret,
        client_name,
        fence,
        &peer,
    )?;
    let proto = |reason: String| VerbsError::Protocol {
        peer: peer.clone(),
        reason,
    };
    let (infos, mut fds, counter_fd) = recv_regions(&stream).map_err(|e| proto(e.to_string()))?;
    let mut regions = Vec::new();
    for info in &infos {
        let fd = fds.remove(0);
        let region = Region::map_fd(fd, info.len, info.rkey, info.access)
            .map_err(|e| proto(format!("cannot map region {:#x}: {e}", info.rkey)))?;
        regions.push(Arc::new(region));
    }
    let counters = Region::map_fd(counter_fd, COUNTER_BLOCK_LEN, 0, Access::ALL)
        .map_err(|e| proto(format!("cannot map the counter block: {e}")))?;
    let node_gone = Arc::new(AtomicBool::new(false));
    let mut watch = stream
        .try_clone()
        .map_err(|e| proto(format!("cannot watch the connection: {e}")))?;
    let flag = node_gone.clone();
    std::thread::Builder::new()
        .name("shm-liveness".into())
        .spawn(move || {
            let mut buf = [0u8; 16];
            // The node never sends anything: the read returns when the connection closes.
            while let Ok(n) = std::io::Read::read(&mut watch, &mut buf) {
                if n == 0 {
                    break;
                }
            }
            flag.store(true, Ordering::Release);
        })
        .map_err(|e| proto(format!("cannot start the liveness watcher: {e}")))?;
    Ok(QueuePair(Arc::new(Transport::Shm(ShmQp {
        table: RegionTable::new(regions),
        infos,
        counters: VerbCounters::in_region(Arc::new(counters)),
        node_id: accepted.welcome.node_id,
        peer: format!("{} ({peer})", accepted.node_name),
        node_gone,
        liveness: stream,
    }))))
}

/// Node side: sets the node's lease deadline in shm client block `block` ([`LEASE_WORD`]);
/// `raise` only ever moves it later.
pub fn set_lease(block: &Region, until: u64, raise: bool) {
    let w = block.shared_word(LEASE_WORD);
    if raise {
        w.fetch_max(until, Ordering::SeqCst);
    } else {
        w.store(until, Ordering::SeqCst);
    }
}

/// Node side: fences the shm client of counter block `block` (see the module docs). Returns
/// whether it is fenced: `false` if a batch of it stayed in progress for `wait` (the client
/// stopped inside a batch; only stopping its process fences it then).
pub fn fence_client(block: &Region, wait: std::time::Duration) -> bool {
    block.shared_word(FENCE_WORD).store(1, Ordering::SeqCst);
    let started = std::time::Instant::now();
    while block.shared_word(BUSY_WORD).load(Ordering::SeqCst) != 0 {
        if started.elapsed() >= wait {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    true
}

/// Node side: sends the regions' memfds and a counter block to an authenticated shm client.
pub fn send_regions(
    stream: &UnixStream,
    table: &RegionTable,
    counters: &Region,
) -> std::io::Result<()> {
    let mut body = Vec::new();
    let mut fds: Vec<RawFd> = Vec::new();
    let shared: Vec<_> = table
        .regions()
        .iter()
        .filter(|r| r.memfd().is_some())
        .collect();
    body.extend_from_slice(&(shared.len() as u16).to_le_bytes());
    for r in shared.iter().take(MAX_FDS - 1) {
        let info = r.info();
        body.extend_from_slice(&info.rkey.to_le_bytes());
        body.extend_from_slice(&info.len.to_le_bytes());
        body.push(info.access.bits());
        fds.push(r.memfd().expect("filtered").as_raw_fd());
    }
    fds.push(
        counters
            .memfd()
            .ok_or_else(|| std::io::Error::other("counter block has no memfd"))?
            .as_raw_fd(),
    );
    let mut frame = wire::encode_header(FrameKind::ShmRegions, body.len()).to_vec();
    frame.extend_from_slice(&body);
    let sent = stream.send_with_fd(&frame, &fds)?;
    if sent != frame.len() {
        return Err(std::io::Error::other(
            "short send of the region descriptors",
        ));
    }
    Ok(())
}

type Received = (Vec<RegionInfo>, Vec<OwnedFd>, OwnedFd);

fn recv_regions(stream: &UnixStream) -> Result<Received, WireError> {
    let mut buf = [0u8; 4096];
    let mut raw = [-1 as RawFd; MAX_FDS];
    let (n, nfds) = stream.recv_with_fd(&mut buf, &mut raw)?;
    // SAFETY: the kernel installed these `nfds` descriptors for us in this recvmsg; nothing else
    // owns them, and wrapping each once hands ownership to `OwnedFd`.
    let mut fds: Vec<OwnedFd> = raw[..nfds]
        .iter()
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if n < wire::HEADER_LEN {
        return Err(WireError::malformed(
            "region descriptors",
            format!("only {n} bytes"),
        ));
    }
    let (kind, len) = wire::decode_header(buf[..wire::HEADER_LEN].try_into().expect("8"))?;
    if kind != FrameKind::ShmRegions || len as usize != n - wire::HEADER_LEN {
        return Err(WireError::malformed(
            "region descriptors",
            format!("{kind:?} frame of {len} bytes"),
        ));
    }
    let mut c = Cursor::new(&buf[wire::HEADER_LEN..n], "region descriptors");
    let count = c.u16()? as usize;
    if count + 1 != nfds {
        return Err(WireError::malformed(
            "region descriptors",
            format!("{count} regions but {nfds} descriptors"),
        ));
    }
    let mut infos = Vec::with_capacity(count);
    for _ in 0..count {
        infos.push(RegionInfo {
            rkey: c.u32()?,
            len: c.u64()?,
            access: Access::from_bits(c.u8()?),
        });
    }
    c.finish()?;
    let counter = fds.pop().expect("count + 1 descriptors");
    Ok((infos, fds, counter))
}
