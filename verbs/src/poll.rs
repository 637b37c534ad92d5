//! Reading a socket by polling it briefly before sleeping in the kernel.
//!
//! A control RPC's answer, and a session's next request, mostly arrive within tens of
//! microseconds. A thread that sleeps in `read` for them pays a context switch to wake, and
//! on a CPU that went idle meanwhile its wake-up too: on small virtual machines that costs as
//! much as the round trip itself. So a [`Polled`] reader first tries the socket without
//! blocking for up to its poll time, yielding the CPU between tries so that whoever must
//! produce the bytes can run, and only then blocks (with the socket's own timeout, if set).
//! The tcp NIC threads poll the same way for their work requests (`--poll-us`).

use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a control connection's reader polls before it sleeps, unless configured
/// (`--poll-us` on a node, `poll_us=` on a mount): the nodes' default for their NIC threads.
/// It spans a namespace change's round trip through the metadata standby (100-150 us on the
/// 2-core test machine) and a FUSE-driven client's gap between requests, so a session
/// answering one small-file operation after another mostly finds each next request, and each
/// answer, without sleeping.
pub const CONTROL_POLL: Duration = Duration::from_micros(200);

/// Reads that poll for up to a budget first, and back off while polling does not pay: after
/// `k >=` [`BACK_OFF_AFTER`] polls in a row that found nothing, the next `2^(k - 3)` reads
/// (at most [`MAX_SKIP`]) block at once. So a peer that answers slowly (an idle client
/// between requests, CPUs taken by other work) costs little spinning, while a mix of quick
/// and slow answers (a lookup, then a create that waits for the standby) keeps polling.
#[derive(Debug)]
pub struct Poller {
    poll_us: AtomicU64,
    misses: AtomicU32,
    skip: AtomicU32,
}

/// The most reads a [`Poller`] lets block without polling after polls that found nothing.
pub const MAX_SKIP: u32 = 64;

/// Polls in a row that find nothing before a [`Poller`] backs off.
pub const BACK_OFF_AFTER: u32 = 4;

impl Poller {
    pub fn new(poll: Duration) -> Poller {
        Poller {
            poll_us: AtomicU64::new(poll.as_micros().min(u64::MAX as u128) as u64),
            misses: AtomicU32::new(0),
            skip: AtomicU32::new(0),
        }
    }

    pub fn set(&self, poll: Duration) {
        self.poll_us.store(
            poll.as_micros().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    /// Reads `socket` into `buf`: polling first unless backing off, then with `read`.
    pub fn read<S: AsRawFd + ?Sized>(
        &self,
        socket: &S,
        buf: &mut [u8],
        read: impl FnOnce(&mut [u8]) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        let poll = Duration::from_micros(self.poll_us.load(Ordering::Relaxed));
        if poll.is_zero() {
            return read(buf);
        }
        let skip = self.skip.load(Ordering::Relaxed);
        if skip > 0 {
            self.skip.store(skip - 1, Ordering::Relaxed);
            return read(buf);
        }
        match try_read_for(socket, buf, poll) {
            Some(r) => {
                self.misses.store(0, Ordering::Relaxed);
                r
            }
            None => {
                let k = (self.misses.load(Ordering::Relaxed) + 1).min(BACK_OFF_AFTER + 6);
                self.misses.store(k, Ordering::Relaxed);
                if k >= BACK_OFF_AFTER {
                    let skip = 1u32 << (k + 1 - BACK_OFF_AFTER);
                    self.skip.store(skip.min(MAX_SKIP), Ordering::Relaxed);
                }
                read(buf)
            }
        }
    }
}

/// A reader that polls its socket ([`Poller`]) before a blocking read.
pub struct Polled<R> {
    inner: R,
    poller: Poller,
}

impl<R: Read + AsRawFd> Polled<R> {
    pub fn new(inner: R, poll: Duration) -> Polled<R> {
        Polled {
            inner,
            poller: Poller::new(poll),
        }
    }
}

impl<R: Read + AsRawFd> Read for Polled<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Polled { inner, poller } = self;
        let fd = inner.as_raw_fd();
        // The descriptor itself (a `RawFd` is one): `inner` is borrowed by the blocking read.
        poller.read(&fd, buf, |b| inner.read(b))
    }
}

impl<R: AsRawFd> AsRawFd for Polled<R> {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.inner.as_raw_fd()
    }
}

/// Whether `socket` has something to read now (or is closed or in error: a read then says
/// so), without waiting.
pub fn readable_now(socket: &(impl AsRawFd + ?Sized)) -> bool {
    poll_in(socket.as_raw_fd(), 0).unwrap_or(true)
}

/// One poll(2) for input on `fd`, waiting at most `ms`: whether it is readable (also when
/// closed or in error: the read then reports that).
pub fn poll_in(fd: std::os::fd::RawFd, ms: i32) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid, initialised pollfd; poll only inspects `fd`, for at most `ms`.
    match unsafe { libc::poll(&mut pfd, 1, ms) } {
        n if n < 0 => Err(std::io::Error::last_os_error()),
        n => Ok(n > 0),
    }
}

/// Reads what `socket` has, trying for up to `poll`; `None` if nothing came in that time.
pub fn try_read_for(
    socket: &(impl AsRawFd + ?Sized),
    buf: &mut [u8],
    poll: Duration,
) -> Option<std::io::Result<usize>> {
    if buf.is_empty() || poll.is_zero() {
        return None;
    }
    let started = Instant::now();
    loop {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the whole call, and the
        // descriptor is `socket`'s, open for as long as the borrow lasts.
        let n = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Some(Ok(n as usize));
        }
        let e = std::io::Error::last_os_error();
        if !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        ) {
            return Some(Err(e));
        }
        if started.elapsed() >= poll {
            return None;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn bytes_already_there_are_read_without_blocking() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"hello").unwrap();
        let mut buf = [0u8; 16];
        let got = try_read_for(&b, &mut buf, Duration::from_micros(10)).unwrap();
        assert_eq!(got.unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
    }

    #[test]
    fn nothing_there_gives_up_after_the_poll_time() {
        let (_a, b) = UnixStream::pair().unwrap();
        let mut buf = [0u8; 16];
        let t = Instant::now();
        assert!(try_read_for(&b, &mut buf, Duration::from_millis(2)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(2));
    }

    #[test]
    fn polls_that_find_nothing_back_off_and_one_that_finds_resets() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let p = Poller::new(Duration::from_micros(100));
        let mut buf = [0u8; 16];
        let state = |p: &Poller| {
            (
                p.misses.load(Ordering::Relaxed),
                p.skip.load(Ordering::Relaxed),
            )
        };
        // Nothing is there until the read blocks: every poll misses; reads that skip the poll
        // count the backoff down.
        let mut states = Vec::new();
        for _ in 0..8 {
            let n = p
                .read(&b, &mut buf, |bb| {
                    a.write_all(b"x").unwrap();
                    (&b).read(bb)
                })
                .unwrap();
            assert_eq!(n, 1);
            states.push(state(&p));
        }
        assert_eq!(
            states,
            [
                (1, 0),
                (2, 0),
                (3, 0),
                (4, 2),
                (4, 1),
                (4, 0),
                (5, 4),
                (5, 3)
            ],
            "three misses, then 2 reads without a poll; a miss, then 4 without"
        );
        // The rest of the backoff, then a byte already there when a poll is due: read by the
        // poll, and the backoff resets.
        for _ in 0..3 {
            p.read(&b, &mut buf, |bb| {
                a.write_all(b"x").unwrap();
                (&b).read(bb)
            })
            .unwrap();
        }
        assert_eq!(state(&p), (5, 0));
        a.write_all(b"y").unwrap();
        let n = p
            .read(&b, &mut buf, |_| panic!("polled, not blocked"))
            .unwrap();
        assert_eq!((n, buf[0]), (1, b'y'));
        assert_eq!(state(&p), (0, 0));
    }

    #[test]
    fn a_closed_peer_reads_as_the_end_and_bytes_arriving_later_are_read_by_blocking() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let mut buf = [0u8; 16];
        assert_eq!(
            try_read_for(&b, &mut buf, CONTROL_POLL).unwrap().unwrap(),
            0
        );

        let (mut a, b) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            a.write_all(b"late").unwrap();
        });
        let mut r = Polled::new(b, Duration::from_micros(100));
        let n = r.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"late");
        writer.join().unwrap();
    }
}
