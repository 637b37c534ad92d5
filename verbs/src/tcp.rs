//! The `tcp` transport: a software RDMA NIC over TCP.
//!
//! **Node side** ([`serve_verbs`]): one NIC thread per connection reads request frames, executes
//! their work requests on the region table in order, and writes one response frame per batch.
//! It runs no filesystem, lock or QoS logic. Responses to pipelined batches are flushed together
//! when no further request is already buffered. Large READs at a batch's end are sent straight
//! from the region: the kernel reads each as it sends it, after every request before it.
//!
//! **Client side**: posting encodes the batch and writes it under the writer lock, queueing a
//! completion slot in posting order; large WRITE payloads go to the socket from the caller's
//! buffer, in the same vectored write as the encoded rest. There is no reader thread: whichever waiter finds the reader
//! lock free reads responses itself and hands each to its slot until its own has arrived, then
//! wakes another waiter to take over. On this kind of machine a thread wake-up costs tens of
//! microseconds, so having the waiting thread read its own response saves one per round trip.
//!
//! **Deadlines**: a client waits at most [`TcpOptions::deadline`] for a node that stopped
//! answering (its socket's receive and send timeouts): then the connection fails, every batch
//! on it with it. Each batch carries the client's send time and deadline; a node that finds a
//! batch older than its deadline (it was stopped, and resumed) closes the connection without
//! executing it, so an operation the application was told failed does not land later. The
//! node measures age against the smallest clock offset it has seen on the connection, so
//! the two hosts' clocks need not agree; a batch still executing when the node stops is not
//! fenced.
//!
//! **Adaptive polling**: before blocking in `read`, both sides poll the socket for a short,
//! bounded time ([`TcpOptions::poll`], `rackfs-memnode --poll-us`): back-to-back requests then
//! find their peer awake instead of paying a sleeping CPU's wake-up. An idle connection costs
//! that budget once, then sleeps in the kernel. Zero disables it.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::auth::{client_handshake, Secret};
use crate::counters::VerbCounters;
use crate::poll::poll_in;
use crate::qp::{Posted, QueuePair, Slot, Transport};
use crate::region::{RegionInfo, RegionTable};
use crate::wire::{self, ConnKind, Cursor, FrameKind, WireError, OUTCOME_LEN, RESPONSE_PREFIX};
use crate::wr::{Batch, Completions, Opcode, Outcome, RemoteAddr, WorkRequest};
use crate::VerbsError;

/// What the client remembers of each posted request, to check and interpret its completion.
struct Shape {
    op: Opcode,
    addr: RemoteAddr,
    len: u32,
}

struct InFlight {
    seq: u64,
    shapes: Vec<Shape>,
    slot: Arc<Slot>,
}

struct Writer {
    stream: TcpStream,
    buf: Vec<u8>,
    next_seq: u64,
}

struct Reader {
    stream: BufReader<TcpStream>,
}

/// Client-side knobs of the tcp transport.
#[derive(Clone, Copy, Debug)]
pub struct TcpOptions {
    /// How long a waiting thread polls the socket before sleeping in `read`.
    pub poll: Duration,
    /// How long to wait for a node's answer (or for room to send) before the connection fails.
    pub deadline: Duration,
    /// The token under which the node may fence this connection (0: none; see
    /// [`crate::wire::Hello::fence`]).
    pub fence: u64,
}

/// Default deadline of a batch: as long as a control RPC's.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);

/// Default polling budget on both sides of a connection.
pub const DEFAULT_POLL: Duration = Duration::from_micros(50);

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            poll: DEFAULT_POLL,
            deadline: DEFAULT_DEADLINE,
            fence: 0,
        }
    }
}

/// WRITE payloads of at least this many bytes go to the socket from the caller's buffer (one
/// vectored write with the encoded rest) instead of being copied into the frame first.
const SEND_APART: usize = 2048;

/// Writes `encoded` with each payload of `apart` spliced in at its position (see
/// [`wire::encode_verbs_request_apart`]), in as few `writev` calls as the socket takes.
fn send_spliced(
    stream: &mut TcpStream,
    encoded: &[u8],
    apart: &[(usize, &[u8])],
) -> std::io::Result<()> {
    if apart.is_empty() {
        return stream.write_all(encoded);
    }
    let mut slices = Vec::with_capacity(2 * apart.len() + 1);
    let mut at = 0;
    for (pos, data) in apart {
        slices.push(IoSlice::new(&encoded[at..*pos]));
        slices.push(IoSlice::new(data));
        at = *pos;
    }
    slices.push(IoSlice::new(&encoded[at..]));
    let mut left = &mut slices[..];
    while !left.is_empty() {
        match stream.write_vectored(left) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut left, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Threads of this process polling right now.
static POLLERS: AtomicUsize = AtomicUsize::new(0);

/// At most this many threads of one process poll at once (half the CPUs, at least one): with
/// more, pollers take the CPU from the very threads they wait for. The others sleep in `read`.
fn max_pollers() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1))
}

/// Waits until `fd` is readable (or closed) for at most `deadline`; false when it timed out.
fn wait_readable(fd: RawFd, deadline: Duration) -> bool {
    let end = Instant::now() + deadline;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        match poll_in(fd, ms) {
            Ok(true) => return true,
            // Let the read report the error.
            Err(e) if e.kind() != std::io::ErrorKind::Interrupted => return true,
            _ if Instant::now() >= end => return false,
            _ => {}
        }
    }
}

/// Busy-polls `fd` until it is readable or `budget` has passed (or returns at once when enough
/// other threads are polling already); true when it found `fd` readable (or closed).
pub fn poll_readable(fd: RawFd, budget: Duration) -> bool {
    if budget.is_zero() {
        return false;
    }
    if POLLERS.fetch_add(1, Ordering::AcqRel) >= max_pollers() {
        POLLERS.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    let _done = PollerSlot;
    let end = Instant::now() + budget;
    loop {
        if poll_in(fd, 0).unwrap_or(true) {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        // Yield rather than spin: a thread that shares this CPU (another connection's NIC
        // thread, the client) runs at once instead of waiting for our time slice to end.
        std::thread::yield_now();
    }
}

/// Gives a polling slot back when dropped.
struct PollerSlot;

impl Drop for PollerSlot {
    fn drop(&mut self) {
        POLLERS.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(crate) struct TcpConn {
    peer: String,
    node_id: u32,
    regions: Vec<RegionInfo>,
    writer: Mutex<Writer>,
    reader: Mutex<Reader>,
    in_flight: Mutex<VecDeque<InFlight>>,
    failure: Mutex<Option<VerbsError>>,
    options: TcpOptions,
    fd: RawFd,
}

/// Wall-clock time, ns since the Unix epoch.
pub(crate) fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Connects to a memory node's verbs service at `addr` (host:port).
pub fn connect(addr: &str, secret: &Secret, client_name: &str) -> Result<QueuePair, VerbsError> {
    connect_with(addr, secret, client_name, TcpOptions::default())
}

/// [`connect`] with explicit options.
pub fn connect_with(
    addr: &str,
    secret: &Secret,
    client_name: &str,
    options: TcpOptions,
) -> Result<QueuePair, VerbsError> {
    let mut stream = dial(addr)?;
    // The handshake too: a stopped node's kernel still accepts the connection.
    let bound = Some(options.deadline.max(Duration::from_millis(1)));
    stream
        .set_read_timeout(bound)
        .and_then(|_| stream.set_write_timeout(bound))
        .map_err(|e| connect_err(addr, e))?;
    let accepted = client_handshake(
        &mut stream,
        ConnKind::Verbs,
        secret,
        client_name,
        options.fence,
        addr,
    )?;
    // Reads wait in `wait_readable` (bounded by the deadline), not in a socket timeout.
    stream
        .set_read_timeout(None)
        .map_err(|e| connect_err(addr, e))?;
    let fd = stream.as_raw_fd();
    let conn = TcpConn {
        peer: format!("{} ({addr})", accepted.node_name),
        node_id: accepted.welcome.node_id,
        regions: accepted.welcome.regions,
        writer: Mutex::new(Writer {
            stream: stream.try_clone().map_err(|e| connect_err(addr, e))?,
            buf: Vec::with_capacity(64 << 10),
            next_seq: 0,
        }),
        reader: Mutex::new(Reader {
            stream: BufReader::with_capacity(256 << 10, stream),
        }),
        in_flight: Mutex::new(VecDeque::new()),
        failure: Mutex::new(None),
        options,
        fd,
    };
    Ok(QueuePair(Arc::new(Transport::Tcp(Arc::new(conn)))))
}

fn connect_err(addr: &str, e: std::io::Error) -> VerbsError {
    VerbsError::Connect {
        peer: addr.into(),
        reason: e.to_string(),
    }
}

/// Opens a TCP connection with the options every RackFS connection uses.
pub fn dial(addr: &str) -> Result<TcpStream, VerbsError> {
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| connect_err(addr, e))?
        .collect();
    let mut last = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
            Ok(s) => {
                s.set_nodelay(true).map_err(|e| connect_err(addr, e))?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(connect_err(
        addr,
        last.unwrap_or_else(|| std::io::Error::other("address resolved to nothing")),
    ))
}

impl TcpConn {
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }
    pub(crate) fn node_id(&self) -> u32 {
        self.node_id
    }
    pub(crate) fn regions(&self) -> &[RegionInfo] {
        &self.regions
    }

    pub(crate) fn is_broken(&self) -> bool {
        self.failure.lock().expect("failure lock").is_some()
    }

    fn failure(&self) -> Option<VerbsError> {
        self.failure.lock().expect("failure lock").clone()
    }

    /// Marks the connection dead and fails every outstanding batch with `reason`.
    fn fail(&self, reason: String) {
        let err = {
            let mut f = self.failure.lock().expect("failure lock");
            f.get_or_insert_with(|| VerbsError::ConnectionLost {
                peer: self.peer.clone(),
                reason,
            })
            .clone()
        };
        let _ = self
            .writer
            .lock()
            .expect("writer lock")
            .stream
            .shutdown(std::net::Shutdown::Both);
        let drained: Vec<_> = self
            .in_flight
            .lock()
            .expect("in-flight lock")
            .drain(..)
            .collect();
        for f in drained {
            f.slot.complete(Err(err.clone()));
        }
    }

    pub(crate) fn post(self: &Arc<Self>, batch: &Batch<'_>) -> Posted {
        if let Some(e) = self.failure() {
            return Posted::ready(Err(e));
        }
        let slot = Arc::new(Slot::default());
        let shapes = batch
            .requests()
            .iter()
            .map(|wr| Shape {
                op: wr.opcode(),
                addr: wr.addr(),
                len: wr.len() as u32,
            })
            .collect();
        let mut guard = self.writer.lock().expect("writer lock");
        let w = &mut *guard;
        let seq = w.next_seq;
        w.next_seq += 1;
        w.buf.clear();
        w.buf.extend_from_slice(&[0; wire::HEADER_LEN]);
        let head = wire::BatchHead {
            seq,
            sent_ns: wall_ns(),
            deadline_ms: self.options.deadline.as_millis().min(u32::MAX as u128) as u32,
        };
        let apart =
            wire::encode_verbs_request_apart(&mut w.buf, &head, batch.requests(), SEND_APART);
        let body_len =
            w.buf.len() - wire::HEADER_LEN + apart.iter().map(|a| a.1.len()).sum::<usize>();
        let header = wire::encode_header(FrameKind::VerbsRequest, body_len);
        w.buf[..wire::HEADER_LEN].copy_from_slice(&header);
        self.in_flight
            .lock()
            .expect("in-flight lock")
            .push_back(InFlight {
                seq,
                shapes,
                slot: slot.clone(),
            });
        let sent = send_spliced(&mut w.stream, &w.buf, &apart);
        if w.buf.capacity() > 1 << 20 {
            w.buf = Vec::with_capacity(64 << 10);
        }
        drop(guard);
        if let Err(e) = sent {
            self.fail(format!(
                "send failed (the node takes no data within {:?}?): {e}",
                self.options.deadline
            ));
        }
        Posted::tcp(slot, self.clone())
    }

    /// Drives the connection until `slot` completes (see the module docs).
    pub(crate) fn poll_slot(
        &self,
        slot: &Slot,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Completions, VerbsError>> {
        let mut registered = false;
        let mut was_reader = false;
        loop {
            if let Some(r) = slot.take() {
                if was_reader {
                    self.hand_over();
                }
                return Poll::Ready(r);
            }
            match self.reader.try_lock() {
                Ok(mut reader) => {
                    was_reader = true;
                    if slot.is_done() {
                        continue; // completed by the previous reader: release the lock first
                    }
                    let ready = !reader.stream.buffer().is_empty()
                        || poll_readable(self.fd, self.options.poll)
                        || wait_readable(self.fd, self.options.deadline);
                    let read = if ready {
                        self.read_one(&mut reader)
                    } else {
                        Err(format!(
                            "no answer within {:?} (the node is stopped or overloaded)",
                            self.options.deadline
                        ))
                    };
                    if let Err(reason) = read {
                        drop(reader);
                        self.fail(reason);
                    }
                }
                Err(_) if !registered => {
                    // Register, then try the reader lock once more: either we get it, or its
                    // holder releases it after our waker is visible to `hand_over`.
                    slot.set_waker(cx.waker());
                    registered = true;
                }
                Err(_) => return Poll::Pending,
            }
        }
    }

    /// Wakes one waiting poster so the connection keeps a reader while batches are outstanding.
    fn hand_over(&self) {
        let q = self.in_flight.lock().expect("in-flight lock");
        for f in q.iter() {
            if f.slot.wake_waiter() {
                return;
            }
        }
    }

    /// Reads one response frame and completes its batch's slot.
    fn read_one(&self, reader: &mut Reader) -> Result<(), String> {
        let mut body = Vec::new();
        let kind = wire::read_frame(&mut reader.stream, &mut body).map_err(|e| e.to_string())?;
        if kind != FrameKind::VerbsResponse {
            return Err(format!("expected a verbs response, got a {kind:?} frame"));
        }
        let front = self
            .in_flight
            .lock()
            .expect("in-flight lock")
            .pop_front()
            .ok_or("response without an outstanding batch")?;
        match decode_response(body, &front) {
            Ok(done) => {
                front.slot.complete(Ok(done));
                Ok(())
            }
            Err(e) => {
                let reason = e.to_string();
                front.slot.complete(Err(VerbsError::Protocol {
                    peer: self.peer.clone(),
                    reason: reason.clone(),
                }));
                Err(reason)
            }
        }
    }
}

fn decode_response(body: Vec<u8>, f: &InFlight) -> Result<Completions, WireError> {
    let what = "verbs response";
    let mut c = Cursor::new(&body, what);
    let seq = c.u64()?;
    let count = c.u16()? as usize;
    if seq != f.seq || count != f.shapes.len() {
        return Err(WireError::malformed(
            what,
            format!(
                "answers batch {seq} with {count} completions; expected batch {} with {}",
                f.seq,
                f.shapes.len()
            ),
        ));
    }
    let mut data_at = RESPONSE_PREFIX + OUTCOME_LEN * count;
    let mut outcomes = Vec::with_capacity(count);
    for s in &f.shapes {
        let status = c.u8()?;
        let value = c.u64()?;
        outcomes.push(if status == 0 {
            match s.op {
                Opcode::Read => {
                    if value != s.len as u64 {
                        return Err(WireError::malformed(
                            what,
                            format!("READ of {} bytes returned {value}", s.len),
                        ));
                    }
                    let start = data_at;
                    data_at += s.len as usize;
                    Outcome::Data {
                        start,
                        len: s.len as usize,
                    }
                }
                Opcode::Write => Outcome::Written,
                _ => Outcome::Value(value),
            }
        } else {
            let e = VerbsError::from_status(
                status,
                value,
                s.op,
                s.addr.rkey,
                s.addr.offset,
                s.len as u64,
            )
            .ok_or_else(|| WireError::malformed(what, format!("unknown status {status}")))?;
            Outcome::Failed(e)
        });
    }
    if data_at != body.len() {
        return Err(WireError::malformed(
            what,
            format!(
                "carries {} bytes of READ data, expected {}",
                body.len() as i64 - c.position() as i64,
                data_at - c.position()
            ),
        ));
    }
    Ok(Completions {
        outcomes,
        data: body,
    })
}

/// Serves work requests on an authenticated verbs connection until the peer closes it.
///
/// Returns `Ok` on an orderly close and the reason otherwise (a malformed frame closes the
/// connection: the caller logs why).
///
/// `poll` is the adaptive-polling budget on `fd` (the connection's socket) before each
/// blocking read. Once `stop` is set (the client was fenced), no further batch is executed
/// and the connection ends; while `lease` has lapsed, a batch closes the connection unexecuted
/// (see [`crate::lease`]). `handshake_offset_ns` is the clock offset the handshake measured
/// ([`crate::auth::Admitted::clock_offset_ns`]).
pub fn serve_verbs(
    input: impl Read,
    output: impl Write,
    (fd, poll): (RawFd, Duration),
    table: &RegionTable,
    counters: &VerbCounters,
    (stop, lease): (&AtomicBool, &crate::lease::ServeLease),
    handshake_offset_ns: i128,
) -> Result<(), WireError> {
    let mut reader = BufReader::with_capacity(256 << 10, input);
    let mut writer = BufWriter::with_capacity(256 << 10, output);
    let mut body = Vec::new();
    // The smallest (our clock - the client's send time) seen: the clocks' offset plus the
    // fastest delivery. A batch's age is how much later than that it arrives.
    // The handshake gave the first sample: a node stopped right after it still finds the
    // connection's first batch late.
    let mut offset_min: Option<i128> = Some(handshake_offset_ns);
    loop {
        if reader.buffer().is_empty() {
            let _ = poll_readable(fd, poll);
        }
        let kind = match wire::read_frame(&mut reader, &mut body) {
            Ok(k) => k,
            Err(WireError::Closed) => return Ok(()),
            Err(e) => return Err(e),
        };
        if kind != FrameKind::VerbsRequest {
            return Err(WireError::Unexpected {
                expected: FrameKind::VerbsRequest,
                got: kind,
            });
        }
        let (head, requests) = wire::decode_verbs_request(&body)?;
        if stop.load(Ordering::SeqCst) {
            // Fenced: this batch and every later one stay unexecuted.
            return Ok(());
        }
        if !lease.valid() {
            return Err(WireError::malformed(
                "verbs request",
                format!(
                    "batch {} refused: this memory node's lease from the primary lapsed (it \
                     may have been declared dead and its data copied elsewhere); the \
                     connection is closed",
                    head.seq
                ),
            ));
        }
        let offset = wall_ns() as i128 - head.sent_ns as i128;
        let least = *offset_min.get_or_insert(offset);
        offset_min = Some(least.min(offset));
        let age_ms = (offset - least) / 1_000_000;
        if head.deadline_ms != 0 && age_ms > head.deadline_ms as i128 {
            return Err(WireError::malformed(
                "verbs request",
                format!(
                    "batch {} arrived {age_ms} ms late, past its {} ms deadline (was this node \
                     stopped?): not executed, and the connection closed",
                    head.seq, head.deadline_ms
                ),
            ));
        }
        let seq = head.seq;
        // From its first large READ on, a batch of nothing but READs is answered straight from
        // the regions (`Region::send`): each is checked now and read by the kernel as it is
        // sent, after every request before it, so the batch's order holds, one copy fewer.
        let (now, later) = requests.split_at(streamed_tail(&requests));
        let read_bytes: usize = now
            .iter()
            .filter(|r| r.opcode() == Opcode::Read)
            .map(|r| r.len() as usize)
            .sum();
        let mut done = Completions::with_capacity(requests.len(), read_bytes);
        let mut totals = crate::counters::VerbTotals::default();
        table.execute_batch(now, &mut done, |wr, ok| tally(&mut totals, wr, ok));
        let mut failed = done
            .outcomes
            .iter()
            .any(|o| matches!(o, Outcome::Failed(_)));
        let mut sends = Vec::new();
        let mut data_at = done.data.len();
        for wr in later {
            if failed {
                done.push(Outcome::Failed(VerbsError::Flushed));
                continue;
            }
            let (addr, len) = (wr.addr(), wr.len() as usize);
            let region = table
                .named(addr.rkey)
                .and_then(|r| r.check(Opcode::Read, addr.offset, len as u64).map(|()| r));
            tally(&mut totals, wr, region.is_ok());
            match region {
                Ok(r) => {
                    sends.push((r, addr.offset, len));
                    done.push(Outcome::Data {
                        start: data_at,
                        len,
                    });
                    data_at += len;
                }
                Err(e) => {
                    done.push(Outcome::Failed(e));
                    failed = true;
                }
            }
        }
        totals.batches = 1;
        counters.add_totals(&totals);

        let streamed: usize = sends.iter().map(|s| s.2).sum();
        let body_len =
            RESPONSE_PREFIX + OUTCOME_LEN * done.outcomes.len() + done.data.len() + streamed;
        let mut head = Vec::with_capacity(
            wire::HEADER_LEN + RESPONSE_PREFIX + OUTCOME_LEN * done.outcomes.len(),
        );
        head.extend_from_slice(&wire::encode_header(FrameKind::VerbsResponse, body_len));
        head.extend_from_slice(&seq.to_le_bytes());
        head.extend_from_slice(&(done.outcomes.len() as u16).to_le_bytes());
        for o in &done.outcomes {
            let (status, value) = match o {
                Outcome::Data { len, .. } => (0, *len as u64),
                Outcome::Value(v) => (0, *v),
                Outcome::Written => (0, 0),
                Outcome::Failed(e) => (e.status_code(), e.status_detail()),
            };
            head.push(status);
            head.extend_from_slice(&value.to_le_bytes());
        }
        writer.write_all(&head)?;
        writer.write_all(&done.data)?;
        if !sends.is_empty() {
            writer.flush()?;
            for (region, offset, len) in sends {
                std::sync::atomic::fence(Ordering::SeqCst);
                region.send(fd, offset, len)?;
            }
        } else if reader.buffer().is_empty() {
            writer.flush()?;
        }
    }
}

/// READs of at least this many bytes at a batch's end are sent straight from the region.
const SEND_FROM_REGION: usize = 64 << 10;

/// Where the streamed end of a batch starts: its first READ of [`SEND_FROM_REGION`] bytes or
/// more followed by nothing but READs (the batch's length if there is none).
fn streamed_tail(requests: &[WorkRequest<'_>]) -> usize {
    let reads_from = requests
        .iter()
        .rposition(|r| r.opcode() != Opcode::Read)
        .map_or(0, |i| i + 1);
    requests[reads_from..]
        .iter()
        .position(|r| r.len() as usize >= SEND_FROM_REGION)
        .map_or(requests.len(), |i| reads_from + i)
}

/// Counts one executed (or refused) request of a served batch.
fn tally(totals: &mut crate::counters::VerbTotals, wr: &WorkRequest<'_>, ok: bool) {
    if ok {
        totals.ops[wr.opcode().index()] += 1;
        totals.bytes[wr.opcode().index()] += wr.len();
    } else {
        totals.errors += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_header, decode_verbs_request, Challenge, Hello, Welcome, HEADER_LEN};
    use proptest::prelude::*;

    fn in_flight(ops: &[(u8, u32)]) -> InFlight {
        InFlight {
            seq: 7,
            shapes: ops
                .iter()
                .map(|&(op, len)| Shape {
                    op: Opcode::from_u8(op % 6 + 1).expect("valid"),
                    addr: RemoteAddr::new(1, 0),
                    len: len % 64,
                })
                .collect(),
            slot: Arc::new(Slot::default()),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Every decoder of the tcp transport takes arbitrary bytes without panicking.
        #[test]
        fn decoders_take_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300),
                                         ops in proptest::collection::vec((any::<u8>(), any::<u32>()), 0..6)) {
            if bytes.len() >= HEADER_LEN {
                let _ = decode_header(bytes[..HEADER_LEN].try_into().unwrap());
            }
            let _ = wire::read_frame(&mut &bytes[..], &mut Vec::new());
            let _ = decode_verbs_request(&bytes);
            let _ = decode_response(bytes.clone(), &in_flight(&ops));
            let _ = Hello::decode(&bytes);
            let _ = Challenge::decode(&bytes);
            let _ = Welcome::decode(&bytes);
        }

        /// Valid responses, mutated: decoding fails cleanly or yields consistent completions.
        #[test]
        fn mutated_responses_are_rejected_or_consistent(
            ops in proptest::collection::vec((any::<u8>(), any::<u32>()), 1..6),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
            cut in any::<Option<usize>>(),
        ) {
            let f = in_flight(&ops);
            let mut body = f.seq.to_le_bytes().to_vec();
            body.extend_from_slice(&(f.shapes.len() as u16).to_le_bytes());
            let mut data = Vec::new();
            for s in &f.shapes {
                body.push(0);
                let v = if s.op == Opcode::Read { s.len as u64 } else { 0 };
                body.extend_from_slice(&v.to_le_bytes());
                if s.op == Opcode::Read { data.extend(std::iter::repeat_n(0xEE, s.len as usize)); }
            }
            body.extend_from_slice(&data);
            prop_assert!(decode_response(body.clone(), &f).is_ok());
            for (i, b) in flips { let n = body.len(); body[i % n] = b; }
            if let Some(c) = cut { body.truncate(c % (body.len() + 1)); }
            if let Ok(done) = decode_response(body, &f) {
                prop_assert_eq!(done.len(), f.shapes.len());
                for (i, s) in f.shapes.iter().enumerate() {
                    if s.op == Opcode::Read {
                        if let Ok(d) = done.data(crate::WrId(i)) { prop_assert_eq!(d.len(), s.len as usize); }
                    }
                }
            }
        }
    }
}
