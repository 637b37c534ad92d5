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
use std::time::{Duration, Instant};

/// How long a control connection's reader polls before it sleeps, unless configured
/// (`--poll-us` on a node, `poll_us=` on a mount): the nodes' default for their NIC threads.
pub const CONTROL_POLL: Duration = Duration::from_micros(50);

/// A reader that polls its socket for up to `poll` before a blocking read.
pub struct Polled<R> {
    inner: R,
    poll: Duration,
}

impl<R: Read + AsRawFd> Polled<R> {
    pub fn new(inner: R, poll: Duration) -> Polled<R> {
        Polled { inner, poll }
    }

    pub fn get_ref(&self) -> &R {
        &self.inner
    }
}

impl<R: Read + AsRawFd> Read for Polled<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match try_read_for(&self.inner, buf, self.poll) {
            Some(r) => r,
            None => self.inner.read(buf),
        }
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
