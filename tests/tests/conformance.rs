//! The verbs conformance suite: one body of cases, run on every transport.

use std::sync::Arc;

use rackfs_tests::{Env, NodeEnv, SimEnv};
use rackfs_verbs::masked::{masked_cas, masked_faa};
use rackfs_verbs::{Batch, Opcode, RemoteAddr, VerbsError, WrId, MAX_BATCH_REQUESTS};

/// Deterministic pattern bytes for a (seed, index).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8)
        .collect()
}

fn round_trips<E: Env>(env: &mut E) {
    let qp = env.qp();
    let r = env.data_region();
    env.run(async move {
        let len = r.len;
        for size in [1u64, 7, 8, 4095, 4096, 4097, 65536, 1 << 20] {
            for off in [0, 1, 4093, len / 2 + 3, len - size] {
                let data = pattern(size ^ off, size as usize);
                let mut b = Batch::new();
                let w = b.write(RemoteAddr::new(r.rkey, off), &data);
                let rd = b.read(RemoteAddr::new(r.rkey, off), size as u32);
                let done = qp.post(b).await.expect("batch");
                done.status(w).expect("write");
                assert_eq!(
                    done.data(rd).expect("read"),
                    &data[..],
                    "size {size} at {off}"
                );
            }
        }
        // The region's very first and last bytes.
        let mut b = Batch::new();
        b.write(RemoteAddr::new(r.rkey, 0), &[0xA5]);
        b.write(RemoteAddr::new(r.rkey, len - 1), &[0x5A]);
        let first = b.read(RemoteAddr::new(r.rkey, 0), 1);
        let last = b.read(RemoteAddr::new(r.rkey, len - 1), 1);
        let done = qp.post(b).await.expect("batch");
        assert_eq!(done.data(first).unwrap(), [0xA5]);
        assert_eq!(done.data(last).unwrap(), [0x5A]);
    });
}

/// Large READs at a batch's end (which tcp sends straight from the region) come back whole and
/// in the batch's order: each sees the requests before it, a failure among them flushes the
/// rest, and a READ that is not at the end (an atomic follows) is answered as any other.
fn large_reads_at_a_batchs_end<E: Env>(env: &mut E) {
    let qp = env.qp();
    let r = env.data_region();
    env.run(async move {
        let (a, b) = (RemoteAddr::new(r.rkey, 0), RemoteAddr::new(r.rkey, 3 << 20));
        let (big, odd) = (pattern(1, 1 << 20), pattern(2, (200 << 10) + 13));
        let mut w = Batch::new();
        w.write(a, &big);
        w.write(b, &odd);
        qp.post(w).await.unwrap().check().unwrap();

        let word = RemoteAddr::new(r.rkey, 2 << 20);
        let mut t = Batch::new();
        t.write_u64(word, 7);
        let first = t.read(a, 1 << 20);
        let small = t.read(word, 8);
        let second = t.read(b, odd.len() as u32);
        let done = qp.post(t).await.unwrap();
        assert_eq!(done.data(first).unwrap(), &big[..]);
        assert_eq!(done.data(small).unwrap(), 7u64.to_le_bytes());
        assert_eq!(done.data(second).unwrap(), &odd[..]);

        // A write after a large read: the read sees the region before it.
        let mut t = Batch::new();
        let before = t.read(a, 1 << 20);
        t.write(a, &odd[..1000]);
        let after = t.read(a, 1000);
        let done = qp.post(t).await.unwrap();
        assert_eq!(done.data(before).unwrap(), &big[..]);
        assert_eq!(done.data(after).unwrap(), &odd[..1000]);

        // A failure among the large reads flushes the rest; the ones before it are whole.
        let mut t = Batch::new();
        let ok = t.read(b, odd.len() as u32);
        let bad = t.read(RemoteAddr::new(r.rkey, r.len - 100), 100 << 10);
        let flushed = t.read(a, 1 << 20);
        let done = qp.post(t).await.unwrap();
        assert_eq!(done.data(ok).unwrap(), &odd[..]);
        assert!(matches!(
            done.status(bad),
            Err(VerbsError::OutOfBounds { .. })
        ));
        assert_eq!(done.status(flushed), Err(VerbsError::Flushed));
        let mut t = Batch::new();
        let bad_key = t.read(RemoteAddr::new(r.rkey ^ 0x5555, 0), 100 << 10);
        let done = qp.post(t).await.unwrap();
        assert!(matches!(
            done.status(bad_key),
            Err(VerbsError::BadKey { .. })
        ));
        qp.post(Batch::new())
            .await
            .expect("the queue pair still works");
    });
}

fn atomics_in_a_batch<E: Env>(env: &mut E) {
    let qp = env.qp();
    let r = env.data_region();
    env.run(async move {
        let a = RemoteAddr::new(r.rkey, 4096);
        let mut b = Batch::new();
        b.write_u64(a, 100);
        let faa = b.faa(a, 5);
        let cas_fail = b.cas(a, 100, 7);
        let cas_ok = b.cas(a, 105, 7);
        let mcas = b.masked_cas(a, 0, 0, 0xF0, 0xF0); // OR 0xF0
        let mfaa = b.masked_faa(a, 0x0101, 1 << 8); // two byte fields
        let rd = b.read(a, 8);
        let done = qp.post(b).await.expect("batch");
        assert_eq!(done.value(faa).unwrap(), 100);
        assert_eq!(
            done.value(cas_fail).unwrap(),
            105,
            "failed CAS returns the current value"
        );
        assert_eq!(done.value(cas_ok).unwrap(), 105);
        assert_eq!(done.value(mcas).unwrap(), 7);
        assert_eq!(done.value(mfaa).unwrap(), 0xF7);
        let expect = masked_faa(0xF7, 0x0101, 1 << 8);
        assert_eq!(done.data(rd).unwrap(), expect.to_le_bytes());
    });
}

fn errors_are_specific<E: Env>(env: &mut E) {
    let qp = env.qp();
    let r = env.data_region();
    let ro = env.ro_region();
    env.run(async move {
        let one = |wr: fn(&mut Batch<'static>, RemoteAddr), addr: RemoteAddr| {
            let mut b = Batch::new();
            wr(&mut b, addr);
            qp.post(b)
        };
        let read8 = |b: &mut Batch<'static>, a| {
            b.read(a, 8);
        };
        let write8 = |b: &mut Batch<'static>, a| {
            b.write(a, &[1u8; 8]);
        };
        let faa = |b: &mut Batch<'static>, a| {
            b.faa(a, 1);
        };
        let cas = |b: &mut Batch<'static>, a| {
            b.cas(a, 0, 1);
        };
        let err = |d: rackfs_verbs::Completions| d.status(WrId(0)).unwrap_err();

        let e = err(one(read8, RemoteAddr::new(r.rkey, r.len - 4))
            .await
            .unwrap());
        assert_eq!(
            e,
            VerbsError::OutOfBounds {
                op: Opcode::Read,
                rkey: r.rkey,
                offset: r.len - 4,
                len: 8,
                region_len: r.len
            }
        );
        let e = err(one(write8, RemoteAddr::new(r.rkey, u64::MAX - 2))
            .await
            .unwrap());
        assert!(
            matches!(
                e,
                VerbsError::OutOfBounds {
                    op: Opcode::Write,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(one(faa, RemoteAddr::new(r.rkey, r.len)).await.unwrap());
        assert!(
            matches!(
                e,
                VerbsError::OutOfBounds {
                    op: Opcode::Faa,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(one(read8, RemoteAddr::new(0xdead_beef, 0)).await.unwrap());
        assert_eq!(e, VerbsError::BadKey { rkey: 0xdead_beef });
        let e = err(one(write8, RemoteAddr::new(ro.rkey, 0)).await.unwrap());
        assert!(
            matches!(
                e,
                VerbsError::AccessDenied {
                    op: Opcode::Write,
                    ..
                }
            ),
            "{e}"
        );
        let e = err(one(faa, RemoteAddr::new(ro.rkey, 0)).await.unwrap());
        assert!(
            matches!(
                e,
                VerbsError::AccessDenied {
                    op: Opcode::Faa,
                    ..
                }
            ),
            "{e}"
        );
        one(read8, RemoteAddr::new(ro.rkey, 0))
            .await
            .unwrap()
            .check()
            .expect("reading a read-only region works");
        let e = err(one(cas, RemoteAddr::new(r.rkey, 4)).await.unwrap());
        assert_eq!(
            e,
            VerbsError::Misaligned {
                op: Opcode::Cas,
                offset: 4
            }
        );
        let e = err(one(faa, RemoteAddr::new(r.rkey, 12)).await.unwrap());
        assert_eq!(
            e,
            VerbsError::Misaligned {
                op: Opcode::Faa,
                offset: 12
            }
        );
        assert!(e.to_string().contains("not 8-byte aligned"));

        // A failure flushes the rest of its batch, and only its batch.
        let target = RemoteAddr::new(r.rkey, 8192);
        let mut b = Batch::new();
        let ok = b.write(target, &[1u8; 8]);
        let bad = b.read(RemoteAddr::new(r.rkey, r.len), 1);
        let flushed = b.write(target, &[2u8; 8]);
        let done = qp.post(b).await.unwrap();
        done.status(ok).unwrap();
        assert!(matches!(
            done.status(bad),
            Err(VerbsError::OutOfBounds { .. })
        ));
        assert_eq!(done.status(flushed), Err(VerbsError::Flushed));
        let mut b = Batch::new();
        let rd = b.read(target, 8);
        let done = qp
            .post(b)
            .await
            .expect("the queue pair still works after an error");
        assert_eq!(
            done.data(rd).unwrap(),
            [1u8; 8],
            "the flushed write did not happen"
        );

        let mut b = Batch::new();
        for _ in 0..=MAX_BATCH_REQUESTS {
            b.read(target, 8);
        }
        assert!(matches!(
            qp.post(b).await,
            Err(VerbsError::BatchTooLarge { .. })
        ));
        let done = qp
            .post(Batch::new())
            .await
            .expect("an empty batch completes");
        assert!(done.is_empty());
    });
}

fn masked_atomics_match_the_model<E: Env>(env: &mut E) {
    let qp = env.qp();
    let r = env.data_region();
    env.run(async move {
        let a = RemoteAddr::new(r.rkey, 16384);
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..300 {
            let init = next();
            let (v1, v2, v3, v4) = (next(), next(), next(), next());
            // Make compares succeed half the time.
            let compare = if i % 2 == 0 { init } else { v1 };
            let mut b = Batch::new();
            b.write_u64(a, init);
            let op = if i % 3 == 0 {
                b.masked_faa(a, v2, v3)
            } else {
                b.masked_cas(a, compare, v4 | v2, v3, v4)
            };
            let rd = b.read(a, 8);
            let done = qp.post(b).await.unwrap();
            assert_eq!(done.value(op).unwrap(), init);
            let expect = if i % 3 == 0 {
                masked_faa(init, v2, v3)
            } else {
                masked_cas(init, compare, v4 | v2, v3, v4)
            };
            assert_eq!(
                u64::from_le_bytes(done.data(rd).unwrap().try_into().unwrap()),
                expect,
                "case {i}"
            );
        }
    });
}

fn counter_value<E: Env>(env: &mut E, addr: RemoteAddr) -> u64 {
    let qp = env.qp();
    env.run(async move {
        let mut b = Batch::new();
        let rd = b.read(addr, 8);
        let done = qp.post(b).await.unwrap();
        u64::from_le_bytes(done.data(rd).unwrap().try_into().unwrap())
    })
}

fn contended_faa_is_exact<E: Env>(env: &mut E) {
    let r = env.data_region();
    let addr = RemoteAddr::new(r.rkey, 24576);
    let (n, m) = (4usize, 1500u64);
    env.run_parallel(n, move |_, qp| async move {
        for i in 0..m {
            // Mix single FAAs and masked FAAs (a 64-bit field) to check they are atomic together.
            let mut b = Batch::new();
            if i % 2 == 0 {
                b.faa(addr, 1)
            } else {
                b.masked_faa(addr, 1, 0)
            };
            qp.post(b).await.unwrap().check().unwrap();
        }
    });
    assert_eq!(counter_value(env, addr), n as u64 * m);
}

fn cas_spin_counter_is_exact<E: Env>(env: &mut E) {
    let r = env.data_region();
    let addr = RemoteAddr::new(r.rkey, 32768);
    let (n, m) = (4usize, 300u64);
    env.run_parallel(n, move |_, qp| async move {
        for _ in 0..m {
            let mut seen = 0;
            loop {
                let mut b = Batch::new();
                let c = b.cas(addr, seen, seen + 1);
                let old = qp.post(b).await.unwrap().value(c).unwrap();
                if old == seen {
                    break;
                }
                seen = old;
            }
        }
    });
    assert_eq!(counter_value(env, addr), n as u64 * m);
}

fn requests_execute_in_order<E: Env>(env: &mut E) {
    let qp = env.qp();
    let r = env.data_region();
    env.run(async move {
        let a = RemoteAddr::new(r.rkey, 40960);
        // Many batches outstanding at once; each reads back what the previous one wrote.
        let mut posted = Vec::new();
        let payloads: Vec<[u8; 8]> = (0..64u64).map(|i| (i + 1).to_le_bytes()).collect();
        for (i, p) in payloads.iter().enumerate() {
            let mut b = Batch::new();
            let rd = b.read(a, 8);
            b.write(a, p);
            posted.push((i, rd, qp.post(b)));
        }
        // Wait in reverse order: completion must not depend on waiting order.
        let mut results = Vec::new();
        while let Some((i, rd, p)) = posted.pop() {
            let done = p.await.unwrap();
            results.push((
                i,
                u64::from_le_bytes(done.data(rd).unwrap().try_into().unwrap()),
            ));
        }
        for (i, seen) in results {
            assert_eq!(
                seen,
                i as u64,
                "batch {i} saw the write of batch {}",
                i as i64 - 1
            );
        }
        // Within one batch: a FAA sees the write just before it.
        let mut b = Batch::new();
        b.write_u64(a, 10);
        let f = b.faa(a, 1);
        let c = b.cas(a, 11, 20);
        let done = qp.post(b).await.unwrap();
        assert_eq!((done.value(f).unwrap(), done.value(c).unwrap()), (10, 11));
    });
}

/// Far more outstanding than one rdma queue pair holds at once: 64 batches of 9 requests
/// (576 work requests; the send queue takes 128), a batch of 1000 requests among them, then
/// 20 batches of 1 MiB reads (20 MiB; the bounce buffer holds 16). Posting waits for room, and
/// every batch completes with its own results, in posting order, whatever order they are
/// waited in.
fn outstanding_beyond_the_send_queue_and_buffer<E: Env>(env: &mut E) {
    let qp = env.qp();
    let r = env.data_region();
    env.run(async move {
        let word = |k: u64| RemoteAddr::new(r.rkey, 65536 + 8 * k);
        let mut posted = Vec::new();
        for i in 0..64u64 {
            let mut b = Batch::new();
            let adds: Vec<_> = (0..8).map(|k| b.faa(word(k), i + 1)).collect();
            let rd = b.read(word(0), 64);
            posted.push((i, adds, rd, qp.post(b)));
            if i == 31 {
                // 1000 requests: eight chains' worth, posted behind the first 32 batches.
                let mut big = Batch::new();
                let ids: Vec<_> = (0..1000u64).map(|k| big.faa(word(8 + k % 16), 1)).collect();
                posted.push((u64::MAX, ids, WrId(0), qp.post(big)));
            }
        }
        // Batch i sees the adds of batches 0..i: 1 + 2 + ... + i before its own.
        while let Some((i, adds, rd, p)) = posted.pop() {
            let done = p.await.expect("batch");
            if i == u64::MAX {
                let olds: Vec<u64> = adds.iter().map(|&id| done.value(id).unwrap()).collect();
                for (k, old) in olds.iter().enumerate() {
                    assert_eq!(*old, (k / 16) as u64, "request {k} of the big batch");
                }
                continue;
            }
            let before = i * (i + 1) / 2;
            for (k, &id) in adds.iter().enumerate() {
                assert_eq!(done.value(id).unwrap(), before, "batch {i}, word {k}");
            }
            let after = before + i + 1;
            assert_eq!(
                done.data(rd).unwrap(),
                [after.to_le_bytes(); 8].concat(),
                "batch {i} reads its own adds"
            );
        }
        let data = pattern(9, 1 << 20);
        qp.post({
            let mut b = Batch::new();
            b.write(RemoteAddr::new(r.rkey, 1 << 20), &data);
            b
        })
        .await
        .unwrap()
        .check()
        .unwrap();
        let reads: Vec<_> = (0..20)
            .map(|_| {
                let mut b = Batch::new();
                let rd = b.read(RemoteAddr::new(r.rkey, 1 << 20), 1 << 20);
                (rd, qp.post(b))
            })
            .collect();
        for (i, (rd, p)) in reads.into_iter().enumerate() {
            let done = p.await.expect("1 MiB read");
            assert!(
                done.data(rd).unwrap() == &data[..],
                "read {i} came back whole"
            );
        }
    });
}

macro_rules! conformance {
    ($modname:ident, $make:expr) => {
        mod $modname {
            use super::*;
            #[test]
            fn round_trips_of_many_sizes_and_offsets() {
                round_trips(&mut $make);
            }
            #[test]
            fn large_reads_at_the_end_of_a_batch() {
                large_reads_at_a_batchs_end(&mut $make);
            }
            #[test]
            fn atomics_in_one_batch() {
                atomics_in_a_batch(&mut $make);
            }
            #[test]
            fn bounds_key_access_and_alignment_errors() {
                errors_are_specific(&mut $make);
            }
            #[test]
            fn masked_atomics_match_the_reference_model() {
                masked_atomics_match_the_model(&mut $make);
            }
            #[test]
            fn contended_faa_total_is_exact() {
                contended_faa_is_exact(&mut $make);
            }
            #[test]
            fn cas_spin_counter_total_is_exact() {
                cas_spin_counter_is_exact(&mut $make);
            }
            #[test]
            fn requests_on_a_queue_pair_execute_in_order() {
                requests_execute_in_order(&mut $make);
            }
            #[test]
            fn more_outstanding_than_a_send_queue_or_bounce_buffer_holds() {
                outstanding_beyond_the_send_queue_and_buffer(&mut $make);
            }
        }
    };
}

conformance!(shm, NodeEnv::new(true));
conformance!(tcp, NodeEnv::new(false));
conformance!(sim, SimEnv::new(42));

/// The rdma transport on a real device or Soft-RoCE (`scripts/rdma-guest` runs this in a QEMU
/// guest): `RACKFS_RDMA_DEVICE` names the device (default rxe0).
#[cfg(feature = "rdma")]
fn rdma_device() -> String {
    std::env::var("RACKFS_RDMA_DEVICE").unwrap_or_else(|_| "rxe0".into())
}

#[cfg(feature = "rdma")]
conformance!(rdma, NodeEnv::over(rackfs_tests::Via::Rdma(rdma_device())));

/// A queue pair in the error state fails the batch with a clear message, and the next batch
/// runs on a newly connected queue pair; the node's memory is untouched by the failure.
#[cfg(feature = "rdma")]
#[test]
fn rdma_queue_pair_errors_reconnect() {
    let mut env = NodeEnv::over(rackfs_tests::Via::Rdma(rdma_device()));
    let qp = env.qp();
    let a = RemoteAddr::new(env.data_region().rkey, 256);
    qp.write(a, &7u64.to_le_bytes()).unwrap();
    qp.rdma_inject_error();
    let e = qp.faa(a, 1).unwrap_err();
    assert!(
        matches!(&e, VerbsError::ConnectionLost { reason, .. } if reason.contains("reconnected")),
        "{e}"
    );
    assert_eq!(qp.faa(a, 1).unwrap(), 7, "the failed FAA did not execute");
    assert_eq!(qp.read(a, 8).unwrap(), 8u64.to_le_bytes());
    assert_eq!(
        env.node.control().stats().unwrap().open[3],
        1,
        "the old queue pair is gone"
    );
}

/// Batches in flight at once on one queue pair: a request failing at the node's NIC (a
/// wrong remote key, injected) fails its own batch with the NIC's status; the batch that
/// completed before it keeps its results; the two posted behind it on the same queue pair
/// fail as flushed (with one batch at a time they would have run on a new queue pair and
/// succeeded); the next batch runs on a new queue pair.
#[cfg(feature = "rdma")]
#[test]
fn rdma_error_completions_fail_their_own_batch_and_those_behind_it() {
    let mut env = NodeEnv::over(rackfs_tests::Via::Rdma(rdma_device()));
    let qp = env.qp();
    let a = RemoteAddr::new(env.data_region().rkey, 512);
    qp.write(a, &100u64.to_le_bytes()).unwrap();
    let faa = |n| {
        let mut b = Batch::new();
        b.faa(a, n);
        qp.post(b)
    };
    let first = faa(1);
    qp.rdma_inject_remote_fault();
    let (faulty, behind, last) = (faa(10), faa(100), faa(1000));
    let first = first.wait().expect("the batch before the fault");
    assert_eq!(first.value(WrId(0)).unwrap(), 100);
    let e = faulty.wait().unwrap_err();
    assert!(
        matches!(&e, VerbsError::ConnectionLost { reason, .. }
            if reason.contains("remote access error") && reason.contains("reconnected")),
        "{e}"
    );
    for p in [behind, last] {
        let e = p.wait().unwrap_err();
        assert!(
            matches!(&e, VerbsError::ConnectionLost { reason, .. } if reason.contains("flushed")),
            "{e}"
        );
    }
    let now = qp.faa(a, 0).expect("a new queue pair");
    assert_eq!(
        now, 101,
        "the faulty batch did not run, nor the ones behind it"
    );
    // The node destroys the failed queue pair when its control connection closes.
    let gone = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(10));
        env.node.control().stats().unwrap().open[3] == 1
    });
    assert!(gone, "the failed queue pair is gone");
}

/// Every wait is bounded: batches that take longer than the connection's deadline (16 MiB
/// reads on Soft-RoCE, against a 20 ms deadline) fail with the deadline in the error, the
/// ones posted behind them too, and the queue pair is reconnected for the next batch.
#[cfg(feature = "rdma")]
#[test]
fn rdma_batches_past_their_deadline_fail_and_the_queue_pair_reconnects() {
    let dev = rdma_device();
    let node = rackfs_tests::MemNodeProcess::start_with(
        "64M",
        rackfs_verbs::Secret::generate(),
        &["--rdma-device", &dev],
    );
    let deadline = std::time::Duration::from_millis(20);
    let qp = rackfs_verbs::rdma::connect_with_deadline(
        &node.tcp,
        &node.secret,
        "test",
        0,
        Some(&dev),
        deadline,
    )
    .expect("rdma connect");
    let rkey = qp.regions()[0].rkey;
    let started = std::time::Instant::now();
    let slow: Vec<_> = (0..3)
        .map(|_| {
            let mut b = Batch::new();
            b.read(RemoteAddr::new(rkey, 0), 16 << 20);
            qp.post(b)
        })
        .collect();
    for p in slow {
        // (Not `unwrap_err`: that would print 16 MiB of completions.)
        let Err(e) = p.wait() else {
            panic!("a 16 MiB read completed within 20 ms");
        };
        assert!(
            matches!(&e, VerbsError::ConnectionLost { reason, .. }
                if reason.contains("no completion within 20ms") || reason.contains("flushed")),
            "{e}"
        );
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "the waits were bounded: {:?}",
        started.elapsed()
    );
    // A small batch takes well under 20 ms, even emulated: one of a few tries succeeds.
    let a = RemoteAddr::new(rkey, 64);
    let ok =
        (0..10).any(|_| qp.write(a, &[7u8; 8]).is_ok() && qp.read(a, 8).ok() == Some(vec![7u8; 8]));
    assert!(ok, "the queue pair was reconnected");
}

/// One node serves tcp, shm and rdma clients on one region at once: each transport's clients
/// count on their own word (atomics of a device without global atomicity are atomic only
/// among that device's requests) and all of them read each other's counts at the end.
#[cfg(feature = "rdma")]
#[test]
fn shm_tcp_and_rdma_clients_share_a_region() {
    let node = rackfs_tests::MemNodeProcess::start_with(
        "16M",
        rackfs_verbs::Secret::generate(),
        &["--rdma-device", &rdma_device()],
    );
    let rdma = || {
        rackfs_verbs::rdma::connect(&node.tcp, &node.secret, "test", 0, Some(&rdma_device()))
            .expect("rdma connect")
    };
    let qps = [node.shm_qp(), node.tcp_qp(), rdma(), rdma()];
    assert_eq!(qps[2].transport(), "rdma");
    assert!(qps[2]
        .rdma_atomics()
        .is_some_and(|a| a.contains("CAS loops")));
    let rkey = qps[0].regions()[0].rkey;
    let word = move |i: usize| RemoteAddr::new(rkey, 64 * [0, 1, 2, 2][i] as u64);
    let m = 300u64;
    let threads: Vec<_> = qps
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, qp)| {
            std::thread::spawn(move || {
                for k in 0..m {
                    qp.faa(word(i), 1).unwrap();
                    // And a write each transport's neighbours will read back.
                    qp.write(RemoteAddr::new(rkey, 4096 + 8 * i as u64), &k.to_le_bytes())
                        .unwrap();
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    for qp in &qps {
        let v = |off: u64| {
            u64::from_le_bytes(
                qp.read(RemoteAddr::new(rkey, off), 8)
                    .unwrap()
                    .try_into()
                    .unwrap(),
            )
        };
        assert_eq!((v(0), v(64), v(128)), (m, m, 2 * m), "{}", qp.transport());
        for i in 0..4 {
            assert_eq!(
                v(4096 + 8 * i),
                m - 1,
                "{} reads {i}'s last write",
                qp.transport()
            );
        }
    }
    let s = node.control().stats().unwrap();
    assert!(s.rdma.is_some_and(|r| r.contains(&rdma_device())
        // Soft-RoCE's atomics are atomic_cap HCA: the node's own go through its device.
        && r.contains("own atomics through a loopback queue pair")));
}

/// Threads sharing one queue pair, each with several batches outstanding, waited for out of
/// order: the waiters take turns driving the connection (on tcp reading the socket, on rdma
/// polling the completion queue) and each gets its own batch's completions. Every FAA's old
/// value is distinct, a thread's batches see the counter grow in the order it posted them,
/// and the total is exact.
fn one_queue_pair_shared_by_threads(via: rackfs_tests::Via) {
    let mut env = NodeEnv::over(via);
    let qp = env.qp();
    let a = RemoteAddr::new(env.data_region().rkey, 8192);
    let (threads, rounds) = (4usize, 150u64);
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let qp = qp.clone();
            std::thread::spawn(move || {
                let mut olds = Vec::new();
                for _ in 0..rounds {
                    let posted: Vec<_> = (0..3)
                        .map(|_| {
                            let mut b = Batch::new();
                            let f = b.faa(a, 1);
                            let rd = b.read(a, 8);
                            (f, rd, qp.post(b))
                        })
                        .collect();
                    let mut got: Vec<_> = posted
                        .into_iter()
                        .rev()
                        .map(|(f, rd, p)| {
                            let done = p.wait().expect("batch");
                            let old = done.value(f).unwrap();
                            let now =
                                u64::from_le_bytes(done.data(rd).unwrap().try_into().unwrap());
                            assert!(now > old, "the read after the FAA sees it: {old} -> {now}");
                            old
                        })
                        .collect();
                    got.reverse();
                    olds.extend(got);
                }
                olds
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        let olds = w.join().expect("worker");
        assert!(
            olds.windows(2).all(|p| p[0] < p[1]),
            "a thread's batches ran in its posting order"
        );
        all.extend(olds);
    }
    all.sort_unstable();
    let total = threads as u64 * rounds * 3;
    assert_eq!(all, (0..total).collect::<Vec<_>>(), "every FAA once");
    assert_eq!(qp.read(a, 8).unwrap(), total.to_le_bytes());
}

#[test]
fn one_tcp_queue_pair_shared_by_threads() {
    one_queue_pair_shared_by_threads(rackfs_tests::Via::Tcp);
}

#[test]
fn one_shm_queue_pair_shared_by_threads() {
    one_queue_pair_shared_by_threads(rackfs_tests::Via::Shm);
}

#[cfg(feature = "rdma")]
#[test]
fn one_rdma_queue_pair_shared_by_threads() {
    one_queue_pair_shared_by_threads(rackfs_tests::Via::Rdma(rdma_device()));
}

/// shm and tcp clients of one node increment one counter: the total is exact.
#[test]
fn shm_and_tcp_clients_share_atomics() {
    let node = rackfs_tests::MemNodeProcess::start("16M");
    let qps = [node.shm_qp(), node.tcp_qp(), node.shm_qp(), node.tcp_qp()];
    let rkey = qps[0].regions()[0].rkey;
    let addr = RemoteAddr::new(rkey, 0);
    let m = 2000u64;
    let threads: Vec<_> = qps
        .iter()
        .cloned()
        .map(|qp| {
            std::thread::spawn(move || {
                (0..m).for_each(|_| {
                    qp.faa(addr, 1).unwrap();
                })
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let total = u64::from_le_bytes(node.tcp_qp().read(addr, 8).unwrap().try_into().unwrap());
    assert_eq!(total, 4 * m);
    // Both transports' verbs are counted by the node.
    let s = node.control().stats().unwrap();
    assert!(s.verbs.ops[Opcode::Faa.index()] >= 4 * m, "{:?}", s.verbs);
    let _ = Arc::new(());
}
