//! Threads, started through a [`Spawn`] handed in by whoever builds the logic (a mount's core,
//! a memory node), so that a simulation decides when their work runs: on a live process they
//! are OS threads ([`Threads`]), in a simulated world threads of one of its processes
//! ([`crate::Turnstile::threads`]).

/// A piece of work for a thread of its own.
pub type Work = Box<dyn FnOnce() + Send + 'static>;

/// Starts threads.
pub trait Spawn: Send + Sync {
    /// Runs `work` on a thread of its own called `name`; an error if none can be made (the
    /// caller logs what is lost).
    fn spawn(&self, name: &str, work: Work) -> std::io::Result<()>;
}

/// OS threads.
#[derive(Debug, Clone, Copy, Default)]
pub struct Threads;

impl Spawn for Threads {
    fn spawn(&self, name: &str, work: Work) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name(name.into())
            .spawn(work)
            .map(|_| ())
    }
}
