//! The only unsafe code of the rdma transport: RAII owners of rdma-core objects (device
//! context with its protection domain, memory registrations, RC queue pairs with their
//! completion queue) and the calls that post and poll.
//!
//! Ownership: a [`Device`] outlives every [`Mr`] and [`Rc`] made from it (they hold an `Arc`).
//! Each object is destroyed exactly once, in `Drop`. `ibv_post_send` and `ibv_poll_cq` are
//! inline functions in `verbs.h`, so they are reached through the context's `ops` table, as
//! the header does.

use std::ffi::CStr;
use std::sync::Arc;

use ibverbs_sys as ffi;

/// Why an rdma-core call failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("no RDMA device{}: {found} (check `ibv_devices`; for Soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`)", .wanted.as_ref().map(|w| format!(" named {w}")).unwrap_or_default())]
    Missing {
        wanted: Option<String>,
        found: String,
    },
    #[error("RDMA device {device}: port 1 is not active (state {state}); check `ibv_devinfo`")]
    PortDown { device: String, state: u32 },
    #[error("RDMA device {device} has no usable GID on port 1 (no RoCE address configured?)")]
    NoGid { device: String },
    #[error("RDMA device {device}: {call} failed: {err}")]
    Call {
        device: String,
        call: &'static str,
        err: std::io::Error,
    },
}

/// An open device: its context, one protection domain, and what its port offers.
pub struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    pub name: String,
    pub gid: [u8; 16],
    pub gid_index: u8,
    pub lid: u16,
    pub mtu: ffi::ibv_mtu,
    /// Outstanding RDMA READs/atomics per queue pair the device accepts.
    pub max_rd_atomic: u8,
    /// `ibv_device_attr::atomic_cap`: 0 none, 1 atomic within the HCA, 2 global.
    pub atomic_cap: u32,
}

// SAFETY: rdma-core objects are thread-safe (verbs are documented as callable from any
// thread); the pointers are owned by this value and freed only in Drop.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

fn call_err(device: &str, call: &'static str, ret: i32) -> DeviceError {
    DeviceError::Call {
        device: device.into(),
        call,
        err: if ret > 0 {
            std::io::Error::from_raw_os_error(ret)
        } else {
            std::io::Error::last_os_error()
        },
    }
}

impl Device {
    /// Opens `name`, or the first device if `None`, on port 1 with the first non-zero GID.
    pub fn open(name: Option<&str>) -> Result<Arc<Device>, DeviceError> {
        let mut n = 0;
        // SAFETY: returns an array of `n` device pointers (or null), freed below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(DeviceError::Missing {
                wanted: name.map(String::from),
                found: "rdma-core lists none".into(),
            });
        }
        let mut names = Vec::new();
        let mut chosen = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: `i < n`: an element of the list; the name is a C string owned by it.
            let (dev, dname) = unsafe {
                let dev = *list.add(i);
                (
                    dev,
                    CStr::from_ptr(ffi::ibv_get_device_name(dev))
                        .to_string_lossy()
                        .into_owned(),
                )
            };
            if chosen.is_none() && name.is_none_or(|w| w == dname) {
                chosen = Some((dev, dname.clone()));
            }
            names.push(dname);
        }
        let ctx = chosen.as_ref().map(|(dev, _)| {
            // SAFETY: `dev` is a live element of the list (opened before the list is freed).
            unsafe { ffi::ibv_open_device(*dev) }
        });
        // SAFETY: the list from ibv_get_device_list, freed once; opened contexts stay valid.
        unsafe { ffi::ibv_free_device_list(list) };
        let (Some((_, dname)), Some(ctx)) = (chosen, ctx) else {
            return Err(DeviceError::Missing {
                wanted: name.map(String::from),
                found: if names.is_empty() {
                    "none found".into()
                } else {
                    format!("found {}", names.join(", "))
                },
            });
        };
        if ctx.is_null() {
            return Err(call_err(&dname, "ibv_open_device", 0));
        }
        let mut dev = Device {
            ctx,
            pd: std::ptr::null_mut(),
            name: dname,
            gid: [0; 16],
            gid_index: 0,
            lid: 0,
            mtu: ffi::IBV_MTU_1024,
            max_rd_atomic: 1,
            atomic_cap: 0,
        };
        dev.query()?;
        // SAFETY: a live context; the PD is freed in Drop.
        dev.pd = unsafe { ffi::ibv_alloc_pd(ctx) };
        if dev.pd.is_null() {
            return Err(call_err(&dev.name, "ibv_alloc_pd", 0));
        }
        Ok(Arc::new(dev))
    }

    fn query(&mut self) -> Result<(), DeviceError> {
        // SAFETY: plain C structs, zero is a valid bit pattern; filled by rdma-core.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a struct of the right type.
        let r = unsafe { ffi::ibv_query_device(self.ctx, &mut attr) };
        if r != 0 {
            return Err(call_err(&self.name, "ibv_query_device", r));
        }
        self.atomic_cap = attr.atomic_cap;
        self.max_rd_atomic = attr.max_qp_rd_atom.clamp(1, 16) as u8;
        // SAFETY: as above; ibv_port_attr is the current layout of _compat_ibv_port_attr.
        let mut port: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context; port 1 exists on every device.
        let r = unsafe { ffi::ibv_query_port(self.ctx, 1, &mut port as *mut _ as *mut _) };
        if r != 0 {
            return Err(call_err(&self.name, "ibv_query_port", r));
        }
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(DeviceError::PortDown {
                device: self.name.clone(),
                state: port.state,
            });
        }
        self.lid = port.lid;
        self.mtu = port.active_mtu.min(ffi::IBV_MTU_4096);
        // The GID to use: `RACKFS_RDMA_GID_INDEX` if set, else the best of the table: an
        // IPv4-mapped address (RoCE v2 over IPv4), then a routable IPv6 one, then link-local.
        let wanted: Option<i32> = std::env::var("RACKFS_RDMA_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok());
        let rank = |g: &[u8; 16]| {
            if g[..10] == [0; 10] && g[10..12] == [0xff, 0xff] {
                3
            } else if g[..2] != [0xfe, 0x80] {
                2
            } else {
                1
            }
        };
        let mut best: Option<(i32, [u8; 16])> = None;
        for i in 0..port.gid_tbl_len.clamp(0, 255) {
            if wanted.is_some_and(|w| w != i) {
                continue;
            }
            // SAFETY: zero is a valid GID; filled by rdma-core for an index below the table length.
            let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: a live context, port 1, an index inside the table.
            let r = unsafe { ffi::ibv_query_gid(self.ctx, 1, i, &mut gid) };
            // SAFETY: every bit pattern of the union is a valid byte array.
            let raw = unsafe { gid.raw };
            if r == 0 && raw != [0; 16] && best.is_none_or(|(_, b)| rank(&raw) > rank(&b)) {
                best = Some((i, raw));
            }
        }
        if let Some((i, raw)) = best {
            self.gid = raw;
            self.gid_index = i as u8;
            return Ok(());
        }
        Err(DeviceError::NoGid {
            device: self.name.clone(),
        })
    }

    /// What the node and `rackfs status` say about atomics on this device.
    pub fn atomics(&self) -> String {
        format!(
            "{} (atomic_cap {}); masked atomics emulated with CAS loops",
            self.name,
            match self.atomic_cap {
                0 => "NONE",
                1 => "HCA",
                _ => "GLOB",
            }
        )
    }

    /// Registers `len` bytes at `addr` for the given remote `access` (plus local write).
    ///
    /// # Safety
    /// The memory must stay mapped for as long as the returned [`Mr`] lives.
    pub unsafe fn register(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        access: ffi::ibv_access_flags,
    ) -> Result<Mr, DeviceError> {
        let flags = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | access.0;
        // SAFETY: a live PD; the caller keeps the memory mapped while the MR lives.
        let mr = unsafe { ffi::ibv_reg_mr(self.pd, addr.cast(), len, flags as i32) };
        if mr.is_null() {
            return Err(call_err(&self.name, "ibv_reg_mr", 0));
        }
        Ok(Mr {
            mr,
            _dev: self.clone(),
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every Mr and Rc holds an Arc of this device, so none is left; each freed once.
        unsafe {
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// A memory registration.
pub struct Mr {
    mr: *mut ffi::ibv_mr,
    _dev: Arc<Device>,
}

// SAFETY: an MR handle is only read after registration; rdma-core objects are thread-safe.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { (*self.mr).lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: a live MR.
        unsafe { (*self.mr).rkey }
    }
    pub fn addr(&self) -> u64 {
        // SAFETY: a live MR.
        unsafe { (*self.mr).addr as u64 }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `Device::register`, deregistered once.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// Where one end of an RC connection is: exchanged over the control channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

/// One work request to post: `local` is (address, length, lkey) of its local buffer.
pub enum Op {
    Read {
        remote: u64,
        rkey: u32,
    },
    Write {
        remote: u64,
        rkey: u32,
    },
    Cas {
        remote: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    Faa {
        remote: u64,
        rkey: u32,
        add: u64,
    },
}

/// The most requests one posted chain may hold (the index part of a work request id).
pub const CHAIN_MAX: usize = 256;

/// The work request id of request `index` of chain `chain`.
pub fn wr_id(chain: u64, index: usize) -> u64 {
    chain << 8 | index as u64
}

/// The chain and the index in it that a work request id names.
pub fn chain_of(wr_id: u64) -> (u64, usize) {
    (wr_id >> 8, (wr_id & 0xff) as usize)
}

/// One completion: the request's id and its status (0 is success).
#[derive(Clone, Copy, Debug)]
pub struct Done {
    pub wr_id: u64,
    pub status: u32,
    pub vendor_err: u32,
}

/// A reliable-connected queue pair with its own completion queue.
pub struct Rc {
    qp: *mut ffi::ibv_qp,
    cq: *mut ffi::ibv_cq,
    dev: Arc<Device>,
}

// SAFETY: posting and polling are serialised by the owner (a mutex in the transport);
// rdma-core's own objects are thread-safe.
unsafe impl Send for Rc {}
// SAFETY: as above.
unsafe impl Sync for Rc {}

impl Rc {
    /// A queue pair of `depth` send entries (no receives: one-sided only). Its completion
    /// queue has room for twice that: the signalled completions not yet polled plus the
    /// error completions of every outstanding request when the queue pair fails.
    pub fn create(dev: &Arc<Device>, depth: u32) -> Result<Rc, DeviceError> {
        // SAFETY: a live context; the CQ is destroyed in Drop.
        let cq = unsafe {
            ffi::ibv_create_cq(
                dev.ctx,
                2 * depth as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(call_err(&dev.name, "ibv_create_cq", 0));
        }
        // SAFETY: zero is valid for the init attributes; the fields that matter are set.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = depth;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: a live PD and CQ.
        let qp = unsafe { ffi::ibv_create_qp(dev.pd, &mut init) };
        if qp.is_null() {
            let e = call_err(&dev.name, "ibv_create_qp", 0);
            // SAFETY: created above, not yet shared.
            unsafe { ffi::ibv_destroy_cq(cq) };
            return Err(e);
        }
        Ok(Rc {
            qp,
            cq,
            dev: dev.clone(),
        })
    }

    pub fn endpoint(&self, psn: u32) -> Endpoint {
        Endpoint {
            // SAFETY: a live QP.
            qpn: unsafe { (*self.qp).qp_num },
            psn,
            lid: self.dev.lid,
            gid: self.dev.gid,
        }
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: u32,
        what: &'static str,
    ) -> Result<(), DeviceError> {
        // SAFETY: a live QP and a fully initialised attribute struct.
        let r = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask as i32) };
        if r != 0 {
            return Err(call_err(&self.dev.name, what, r));
        }
        Ok(())
    }

    /// INIT, RTR and RTS towards `remote`; remote peers may use `access` on our memory.
    pub fn connect(
        &self,
        local_psn: u32,
        remote: &Endpoint,
        access: ffi::ibv_access_flags,
    ) -> Result<(), DeviceError> {
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: zero is valid for the attributes; the masked fields are set.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = 1;
        a.qp_access_flags = access.0;
        self.modify(
            &mut a,
            (M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS).0,
            "ibv_modify_qp(INIT)",
        )?;
        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.dev.mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = self.dev.max_rd_atomic;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = 1;
        a.ah_attr.grh.dgid.raw = remote.gid;
        a.ah_attr.grh.sgid_index = self.dev.gid_index;
        a.ah_attr.grh.hop_limit = 1;
        self.modify(
            &mut a,
            (M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER)
                .0,
            "ibv_modify_qp(RTR)",
        )?;
        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = local_psn;
        a.max_rd_atomic = self.dev.max_rd_atomic;
        self.modify(
            &mut a,
            (M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC)
                .0,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Moves the queue pair to the error state (what a fatal transport error does).
    pub fn fail(&self) -> Result<(), DeviceError> {
        // SAFETY: zero is valid for the attributes; only the state is set.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut a,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE.0,
            "ibv_modify_qp(ERR)",
        )
    }

    /// Posts `ops` as one chain behind one doorbell; only the last is signalled. Each op's
    /// local buffer is (address, length) inside the registration `lkey`. Op `i`'s work request
    /// id is [`wr_id`]`(chain, i)`, so a completion names its chain and its place in it.
    ///
    /// # Safety
    /// Every local buffer must stay valid, and not be touched, until the chain's completion
    /// (or an error completion) has been polled, or the queue pair is destroyed.
    pub unsafe fn post(
        &self,
        ops: &[(Op, u64, u32)],
        lkey: u32,
        chain: u64,
    ) -> Result<(), DeviceError> {
        assert!(
            ops.len() <= CHAIN_MAX,
            "a chain has at most {CHAIN_MAX} requests"
        );
        let mut sges: Vec<ffi::ibv_sge> = ops
            .iter()
            .map(|(_, addr, len)| ffi::ibv_sge {
                addr: *addr,
                length: *len,
                lkey,
            })
            .collect();
        // SAFETY: zero is valid for a work request; the used fields are set below.
        let mut wrs: Vec<ffi::ibv_send_wr> = (0..ops.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let n = ops.len();
        for (i, (op, _, _)) in ops.iter().enumerate() {
            let wr = &mut wrs[i];
            wr.wr_id = wr_id(chain, i);
            wr.num_sge = 1;
            if i + 1 == n {
                wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            match *op {
                Op::Read { remote, rkey } | Op::Write { remote, rkey } => {
                    wr.opcode = if matches!(op, Op::Read { .. }) {
                        ffi::ibv_wr_opcode::IBV_WR_RDMA_READ
                    } else {
                        ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
                    };
                    wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                        remote_addr: remote,
                        rkey,
                    };
                }
                Op::Cas {
                    remote,
                    rkey,
                    compare,
                    swap,
                } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                    wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                        remote_addr: remote,
                        compare_add: compare,
                        swap,
                        rkey,
                    };
                }
                Op::Faa { remote, rkey, add } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                    wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                        remote_addr: remote,
                        compare_add: add,
                        swap: 0,
                        rkey,
                    };
                }
            }
        }
        // Link the chain (the vectors are not resized from here on).
        let sg = sges.as_mut_ptr();
        let base = wrs.as_mut_ptr();
        for i in 0..n {
            // SAFETY: `i < n` indexes both vectors, which outlive the post call below.
            unsafe {
                (*base.add(i)).sg_list = sg.add(i);
                (*base.add(i)).next = if i + 1 < n {
                    base.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the chain is well formed; rdma-core copies the requests before
        // returning (the local buffers are the caller's to keep valid).
        let r = unsafe {
            let post = (*(*self.qp).context)
                .ops
                .post_send
                .expect("post_send in ops");
            post(self.qp, base, &mut bad)
        };
        if r != 0 {
            return Err(call_err(&self.dev.name, "ibv_post_send", r));
        }
        Ok(())
    }

    /// Polls up to `out.len()` completions without blocking.
    pub fn poll(&self, out: &mut Vec<Done>) -> Result<(), DeviceError> {
        // SAFETY: ibv_wc is plain old data; zero is valid.
        let mut wcs: [ffi::ibv_wc; 16] = unsafe { std::mem::zeroed() };
        // SAFETY: a live CQ and room for 16 completions.
        let n = unsafe {
            let poll = (*(*self.cq).context).ops.poll_cq.expect("poll_cq in ops");
            poll(self.cq, wcs.len() as i32, wcs.as_mut_ptr())
        };
        if n < 0 {
            return Err(call_err(&self.dev.name, "ibv_poll_cq", 0));
        }
        for wc in &wcs[..n as usize] {
            let (status, vendor_err) = wc.error().unwrap_or((0, 0));
            out.push(Done {
                wr_id: wc.wr_id(),
                status,
                vendor_err,
            });
        }
        Ok(())
    }
}

impl Drop for Rc {
    fn drop(&mut self) {
        // SAFETY: created in `Rc::create`, destroyed once, QP before its CQ.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}
