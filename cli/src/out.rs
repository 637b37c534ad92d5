//! Writing to stdout like a Unix tool. `println!` panics when the reader is gone
//! (`rackfs status | head -1`); [`outln!`](crate::outln) ends the command quietly with
//! status 0 instead, as `ls | head` does. SIGPIPE stays ignored (Rust's default), so a
//! serving process never dies of a peer's broken socket; a process that serves prints with
//! [`noteln!`](crate::noteln), which drops what nobody reads and carries on.

use std::fmt;
use std::io::{self, Write};

/// Writes to stdout; a closed pipe ends the process with status 0, another write error with
/// status 1 and a message. For one-shot commands, whose output is all they are for.
pub fn print(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args) {
        exit_on_write_error(e);
    }
}

/// Writes to stdout and drops what cannot be written: for a process that serves (`rackfs up`
/// in the foreground), which must not stop, nor leave its mount and nodes behind, because
/// nobody reads its messages.
pub fn print_lossy(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    let _ = out.write_fmt(args).and_then(|()| out.flush());
}

/// Writes to stderr and drops what cannot be written (the serving process's warnings).
pub fn eprint_lossy(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// How a one-shot command ends when stdout fails: quietly on a closed pipe, else with the
/// reason.
pub fn exit_on_write_error(e: io::Error) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    let _ = writeln!(io::stderr(), "{}: cannot write to stdout: {e}", program());
    std::process::exit(1)
}

/// This program's name, for messages.
fn program() -> String {
    std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "rackfs".into())
}

/// `println!` for one-shot commands: ends the process quietly (status 0) on a closed pipe.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::out::print(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::print(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `println!` for a serving process: what nobody reads is dropped, and it carries on.
#[macro_export]
macro_rules! noteln {
    ($($arg:tt)*) => {
        $crate::out::print_lossy(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` for a serving process: what cannot be written is dropped.
#[macro_export]
macro_rules! enoteln {
    ($($arg:tt)*) => {
        $crate::out::eprint_lossy(format_args!("{}\n", format_args!($($arg)*)))
    };
}
