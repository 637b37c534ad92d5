//! Queue pairs: the one handle every user of remote memory holds, whatever the transport.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::region::RegionInfo;
use crate::wr::{Batch, Completions, RemoteAddr};
use crate::{rdma, shm, sim, tcp, VerbsError};

/// A connection from a client to one memory node over which work requests are posted.
///
/// Cloning is cheap and clones share the connection. Requests on one queue pair execute in the
/// order they were posted (batches included); many batches may be outstanding at once. Any
/// number of threads may post and wait concurrently.
#[derive(Clone)]
pub struct QueuePair(pub(crate) Arc<Transport>);

pub(crate) enum Transport {
    Shm(shm::ShmQp),
    Tcp(Arc<tcp::TcpConn>),
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Rdma(Arc<rdma::RdmaConn>),
    Sim(sim::SimQp),
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QueuePair({} to {})", self.transport(), self.peer())
    }
}

impl QueuePair {
    /// Posts a batch; the returned [`Posted`] completes when every request in it has.
    pub fn post(&self, batch: Batch<'_>) -> Posted {
        if let Err(e) = batch.check_limits() {
            return Posted::ready(Err(e));
        }
        match &*self.0 {
            Transport::Shm(qp) => Posted::ready(qp.execute(&batch)),
            Transport::Tcp(conn) => conn.post(&batch),
            Transport::Rdma(conn) => conn.post(&batch),
            Transport::Sim(qp) => qp.post(batch),
        }
    }

    /// Posts a batch and blocks until it completes (one round trip).
    pub fn execute(&self, batch: Batch<'_>) -> Result<Completions, VerbsError> {
        self.post(batch).wait()
    }

    /// Reads `len` bytes.
    pub fn read(&self, addr: RemoteAddr, len: u32) -> Result<Vec<u8>, VerbsError> {
        let mut b = Batch::new();
        let id = b.read(addr, len);
        let done = self.execute(b)?;
        Ok(done.data(id)?.to_vec())
    }

    pub fn write(&self, addr: RemoteAddr, data: &[u8]) -> Result<(), VerbsError> {
        let mut b = Batch::new();
        let id = b.write(addr, data);
        self.execute(b)?.status(id)
    }

    /// Compare-and-swap; returns the old value (the swap happened iff it equals `compare`).
    pub fn cas(&self, addr: RemoteAddr, compare: u64, swap: u64) -> Result<u64, VerbsError> {
        let mut b = Batch::new();
        let id = b.cas(addr, compare, swap);
        self.execute(b)?.value(id)
    }

    /// Fetch-and-add; returns the old value.
    pub fn faa(&self, addr: RemoteAddr, add: u64) -> Result<u64, VerbsError> {
        let mut b = Batch::new();
        let id = b.faa(addr, add);
        self.execute(b)?.value(id)
    }

    /// The regions the node registered, as learned at connection time.
    pub fn regions(&self) -> &[RegionInfo] {
        match &*self.0 {
            Transport::Shm(qp) => qp.regions(),
            Transport::Tcp(conn) => conn.regions(),
            Transport::Rdma(conn) => conn.regions(),
            Transport::Sim(qp) => qp.regions(),
        }
    }

    /// The memory node's id.
    pub fn node_id(&self) -> u32 {
        match &*self.0 {
            Transport::Shm(qp) => qp.node_id(),
            Transport::Tcp(conn) => conn.node_id(),
            Transport::Rdma(conn) => conn.node_id(),
            Transport::Sim(_) => 0,
        }
    }

    pub fn peer(&self) -> &str {
        match &*self.0 {
            Transport::Shm(qp) => qp.peer(),
            Transport::Tcp(conn) => conn.peer(),
            Transport::Rdma(conn) => conn.peer(),
            Transport::Sim(_) => "sim",
        }
    }

    /// Whether the connection has failed for good (every later post fails): the caller should
    /// connect anew. Only tcp connections and fenced shm ones know this ahead of a post.
    pub fn is_broken(&self) -> bool {
        match &*self.0 {
            Transport::Tcp(conn) => conn.is_broken(),
            Transport::Shm(qp) => qp.is_fenced(),
            _ => false,
        }
    }

    /// `"shm"`, `"tcp"`, `"rdma"` or `"sim"`.
    pub fn transport(&self) -> &'static str {
        match &*self.0 {
            Transport::Shm(_) => "shm",
            Transport::Tcp(_) => "tcp",
            Transport::Rdma(_) => "rdma",
            Transport::Sim(_) => "sim",
        }
    }

    /// On rdma: moves the queue pair to the error state, as a fatal transport error would, to
    /// test recovery (the next post fails; the one after runs on a new queue pair).
    #[doc(hidden)]
    pub fn rdma_inject_error(&self) {
        if let Transport::Rdma(conn) = &*self.0 {
            conn.inject_error();
        }
    }

    /// On rdma: sends the next posted chain's first request to a remote key the node does not
    /// have, so the node's NIC fails it (a remote access error) and the queue pair with it, to
    /// test that the failure reaches the right batch.
    #[doc(hidden)]
    pub fn rdma_inject_remote_fault(&self) {
        if let Transport::Rdma(conn) = &*self.0 {
            conn.inject_remote_fault();
        }
    }

    /// On rdma: the device's atomics and how masked atomics are done (`None` elsewhere).
    pub fn rdma_atomics(&self) -> Option<&str> {
        match &*self.0 {
            Transport::Rdma(conn) => Some(conn.atomics()),
            _ => None,
        }
    }

    /// The clock protocols on this queue pair must use (virtual time on `sim`).
    pub fn clock(&self) -> Clock {
        match &*self.0 {
            Transport::Sim(qp) => Clock::Sim(qp.handle()),
            _ => Clock::Real,
        }
    }
}

/// A posted batch: a future of its completions, or [`Posted::wait`] to block for them.
#[must_use = "a posted batch does nothing visible until its completions are awaited"]
pub struct Posted(PostedState);

enum PostedState {
    Ready(Option<Result<Completions, VerbsError>>),
    Tcp(Arc<Slot>, Arc<tcp::TcpConn>),
    /// A batch on an rdma queue pair, and when it must have completed.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Rdma(Arc<Slot>, Arc<rdma::RdmaConn>, Instant),
    Sim(Arc<Slot>),
}

impl Posted {
    pub(crate) fn ready(r: Result<Completions, VerbsError>) -> Posted {
        Posted(PostedState::Ready(Some(r)))
    }
    pub(crate) fn tcp(slot: Arc<Slot>, conn: Arc<tcp::TcpConn>) -> Posted {
        Posted(PostedState::Tcp(slot, conn))
    }
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn rdma(slot: Arc<Slot>, conn: Arc<rdma::RdmaConn>, deadline: Instant) -> Posted {
        Posted(PostedState::Rdma(slot, conn, deadline))
    }
    pub(crate) fn sim(slot: Arc<Slot>) -> Posted {
        Posted(PostedState::Sim(slot))
    }

    /// Blocks the calling thread until the batch completes. Not for `sim` queue pairs, whose
    /// batches complete only while [`crate::sim::Sim::run`] drives virtual time.
    pub fn wait(self) -> Result<Completions, VerbsError> {
        match self.0 {
            PostedState::Ready(Some(r)) => r,
            _ => block_on(self),
        }
    }
}

impl Future for Posted {
    type Output = Result<Completions, VerbsError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            PostedState::Ready(r) => Poll::Ready(r.take().expect("Posted polled after completion")),
            PostedState::Tcp(slot, conn) => conn.poll_slot(slot, cx),
            PostedState::Rdma(slot, conn, deadline) => conn.poll_slot(slot, *deadline, cx),
            PostedState::Sim(slot) => slot.poll(cx),
        }
    }
}

/// Where a transport leaves one batch's completions for its waiter.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    result: Option<Result<Completions, VerbsError>>,
    waker: Option<Waker>,
}

impl Slot {
    pub(crate) fn complete(&self, r: Result<Completions, VerbsError>) {
        let waker = {
            let mut s = self.state.lock().expect("slot lock");
            s.result = Some(r);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state.lock().expect("slot lock").result.is_some()
    }

    pub(crate) fn take(&self) -> Option<Result<Completions, VerbsError>> {
        self.state.lock().expect("slot lock").result.take()
    }

    pub(crate) fn set_waker(&self, w: &Waker) {
        let mut s = self.state.lock().expect("slot lock");
        if !s.waker.as_ref().is_some_and(|old| old.will_wake(w)) {
            s.waker = Some(w.clone());
        }
    }

    /// Wakes the waiter if one is registered; returns whether one was.
    pub(crate) fn wake_waiter(&self) -> bool {
        let w = self.state.lock().expect("slot lock").waker.take();
        match w {
            Some(w) => {
                w.wake();
                true
            }
            None => false,
        }
    }

    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<Completions, VerbsError>> {
        let mut s = self.state.lock().expect("slot lock");
        match s.result.take() {
            Some(r) => Poll::Ready(r),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on the calling thread (parking while it is pending).
///
/// This is how blocking callers (FUSE worker threads, CLIs) drive the async protocol code.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    thread_local! {
        static WAKER: Waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    }
    let mut fut = std::pin::pin!(fut);
    let waker = WAKER.with(Waker::clone);
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Time as protocols see it: the host's monotonic clock, or the simulation's virtual clock.
#[derive(Clone)]
pub enum Clock {
    Real,
    Sim(sim::SimHandle),
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Clock {
    /// Time since an arbitrary fixed origin (process start, or the simulation's start).
    pub fn now(&self) -> Duration {
        match self {
            Clock::Real => epoch().elapsed(),
            Clock::Sim(h) => h.now(),
        }
    }

    /// A future that completes after `d`. On the real clock it blocks the polling thread (the
    /// protocols run one operation per thread under [`block_on`]); waits under 200 us spin.
    pub fn sleep(&self, d: Duration) -> Sleep {
        Sleep {
            clock: self.clone(),
            deadline: self.now() + d,
            armed: false,
        }
    }
}

/// See [`Clock::sleep`].
pub struct Sleep {
    clock: Clock,
    deadline: Duration,
    armed: bool,
}

impl Future for Sleep {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let now = this.clock.now();
        if now >= this.deadline {
            return Poll::Ready(());
        }
        match &this.clock {
            Clock::Real => {
                // Short waits (lock polls, Twait) spin with yields: the kernel's sleep cannot
                // wake sooner than ~50 us on this kind of host.
                let left = this.deadline - now;
                if left < Duration::from_micros(200) {
                    while this.clock.now() < this.deadline {
                        std::thread::yield_now();
                    }
                } else {
                    std::thread::sleep(left);
                }
                Poll::Ready(())
            }
            Clock::Sim(h) => {
                if !this.armed {
                    h.wake_at(this.deadline, cx.waker().clone());
                    this.armed = true;
                }
                Poll::Pending
            }
        }
    }
}
