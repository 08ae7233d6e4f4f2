//! GEMM + All-to-All: the exchange of each finished wave group's rows runs
//! while the rest of the GEMM computes.
//!
//! Caller's stream S: [fork] GEMM (stores per-segment into the send buffer, signals) [wait join]
//! Comm stream C:     [wait fork] wait(c0) c0=0 {send/recv g0 with every peer} wait(c1) ... [join]
//!
//! With the copy-engine backend each group's rows for peer p go into p's
//! staging slot for this rank (at their offset among all the rows this rank
//! sends p, which p computes alike from its receive split), and p's reduce
//! stream copies them into its output: no SM moves a byte, so the GEMM
//! keeps every SM (ops/copy_engine.rs). With the push backend (2 ranks,
//! sm_90) the GEMM stores the bands holding the peer's rows straight into
//! the peer's slot (over NVLink, as it computes them; a band holding rows
//! of both ranks is stored here too: plan::all_to_all::pushed_store_rows),
//! and each rank's reduce stream copies what landed, and its own rows, into
//! its output.
//!
//! The plan (plan/all_to_all.rs) gives each group the same fraction of every
//! destination's rows; every rank must call with the same group count.
//! Splits change from call to call (MoE routing), so the tables are made per
//! routing (a few microseconds of host work) and uploaded by the caller
//! into memory from torch's allocator, which it caches per routing (and
//! keeps for CUDA graphs that captured it).

use super::copy_engine::{self, Group, Moves, Piece};
use super::gemm::{self, GemmArgs, Signals};
use super::gemm_all_reduce::{check_push, Backend, Machine, NCCL_RESERVED_SMS};
use crate::comm::communicator::Communicator;
use crate::comm::peer::PeerBuffers;
use crate::cuda::driver;
use crate::cuda::kernels::GemmKernel;
use crate::cuda::stream::{self, RawStream};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::all_to_all::{
    pushed_slot_rows, pushed_store_rows, pushed_tiles, recv_phases, Layout,
};
use crate::plan::predictor::Segments;
use crate::plan::{
    best_all_to_all_groups, call_us, default_raster_bands, plan_gemm_all_to_all, AllToAllPlan,
    AllToAllShape, CollectiveKind, OutputTiles, Timeline,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub kernel: Option<GemmKernel>,
    pub groups: u32,
    /// SMs left free of GEMM CTAs for the exchanges; None: the backend's
    /// default (NCCL: NCCL_RESERVED_SMS; copy engines: none, they use no SM).
    pub reserved_sms: Option<u32>,
    pub backend: Backend,
}

impl Options {
    fn reserved(&self) -> u32 {
        self.reserved_sms.unwrap_or(match self.backend {
            Backend::Nccl => NCCL_RESERVED_SMS,
            Backend::CopyEngine | Backend::Peer | Backend::Push => 0,
        })
    }

    /// The CTAs the GEMM runs on a device of `sms` SMs: what the plan's
    /// raster blocks, the launch and the predictor all count with.
    fn ctas(&self, sms: u32) -> u32 {
        sms.saturating_sub(self.reserved()).max(1)
    }
}

/// The whole routing, the same on every rank (`matrix[p][q]`: rows rank p
/// sends rank q), and the rank calling: what the natural layout is made of.
#[derive(Debug, Clone, Copy)]
pub struct Routing<'a> {
    pub matrix: &'a [Vec<u64>],
    pub me: usize,
}

/// The plan of a call: its kernel, and the exchanges of every group.
/// `routing` known: the natural layout, one band grid over x's rows (the
/// push backend's only one); None: each destination padded to whole bands.
/// Each group is rastered for the CTAs the GEMM gets on `sms` SMs.
pub fn plan_for(
    args: &GemmArgs,
    send_splits: &[u64],
    recv_splits: &[u64],
    routing: Option<Routing>,
    opts: &Options,
    sms: u32,
    major: i32,
) -> Result<(GemmKernel, AllToAllPlan)> {
    match opts.backend {
        Backend::Peer => return Err(Backend::peer_unsupported("gemm_all_to_all")),
        Backend::Push => {
            check_push(send_splits.len() as u32, major, opts.kernel)?;
            if routing.is_none() {
                return Err(Error::Invalid(
                    "backend: the 'push' All-to-All needs split_matrix (its layout is made from \
                     the whole routing)"
                        .into(),
                ));
            }
        }
        Backend::Nccl | Backend::CopyEngine => {}
    }
    let sent: u64 = send_splits.iter().sum();
    if sent != u64::from(args.m) {
        return Err(Error::Invalid(format!(
            "input_split_sizes: must sum to the rows of x ({}), got {sent}",
            args.m
        )));
    }
    let kernel = opts
        .kernel
        .unwrap_or_else(|| GemmKernel::default_for(major));
    let phases = routing.map(|r| recv_phases(r.matrix, r.me)).transpose()?;
    let layout = match &phases {
        Some(recv_phases) => Layout::Natural { recv_phases },
        None => Layout::Padded,
    };
    let plan = plan_gemm_all_to_all(
        send_splits,
        recv_splits,
        args.n,
        gemm::tile_shape(kernel),
        opts.groups,
        layout,
    )?;
    let ctas = opts.ctas(sms);
    let bands = match u32::try_from(plan.send_buffer_rows) {
        Ok(rows) if rows > 0 => default_raster_bands(
            &OutputTiles::new(rows, args.n, gemm::tile_shape(kernel))?,
            ctas,
        ),
        _ => 1,
    };
    Ok((kernel, plan.rastered(bands)))
}

/// What the predictor picks for a routing: the fastest group count, whether
/// the library GEMM then one exchange beats it, and every candidate's timeline.
#[derive(Debug, Clone)]
pub struct GroupChoice {
    pub groups: u32,
    pub sequential: bool,
    pub timelines: Vec<(u32, Timeline)>,
    /// What an overlapped call pays once beyond its timeline (more than one group).
    pub fixed_us: f64,
}

impl GroupChoice {
    /// The chosen group count's overlapped time, per-call cost included.
    pub fn overlap_us(&self) -> f64 {
        let t = &self.timelines[self.groups as usize - 1].1;
        call_us(self.groups, t, self.fixed_us)
    }

    /// The predicted time of the schedule chosen (for "auto" backend choice).
    pub fn predicted_us(&self) -> f64 {
        if self.sequential {
            self.timelines[self.groups as usize - 1].1.sequential_us
        } else {
            self.overlap_us()
        }
    }
}

/// The group count the predictor picks for the whole routing
/// (`matrix[p][q]`: rows rank p sends rank q), and whether the sequential
/// schedule is predicted faster than it. Each rank passes the same matrix and gets the same
/// answer: nothing rank-specific enters the model (the kernel and the
/// profile lookup use the largest rank's rows). `segments`: None, the op's
/// layout (natural: the matrix is known); Some for replays of runs measured
/// with another.
#[allow(clippy::too_many_arguments)]
pub fn choose_groups(
    n: u32,
    k: u32,
    dtype: Dtype,
    matrix: &[Vec<u64>],
    opts: &Options,
    sms: u32,
    major: i32,
    segments: Option<Segments>,
) -> Result<GroupChoice> {
    let rows = matrix
        .iter()
        .map(|r| r.iter().sum::<u64>())
        .max()
        .unwrap_or(0);
    let rows = u32::try_from(rows.max(1)).map_err(|_| {
        Error::Invalid(format!(
            "split_matrix: a rank sends {rows} rows, more than 2**32"
        ))
    })?;
    let reserved = opts.reserved();
    let ctas = opts.ctas(sms);
    let kernel = opts
        .kernel
        .unwrap_or_else(|| GemmKernel::default_for(major));
    let args = GemmArgs {
        x: 0,
        weight: 0,
        out: 0,
        m: rows,
        n,
        k,
        dtype,
    };
    let machine = Machine {
        sms,
        major,
        backend: opts.backend,
        reserved,
        fused_norm: false,
        combined: false,
    };
    let world = matrix.len() as u32;
    let hw = machine.model(&args, world, kernel, CollectiveKind::AllToAll);
    let shape = AllToAllShape {
        matrix,
        n,
        k,
        elem_bytes: dtype.bytes(),
        tile: gemm::tile_shape(kernel),
        ctas,
        segments: segments.unwrap_or(Segments::Natural),
    };
    let (groups, timelines) =
        best_all_to_all_groups(&shape, &hw, crate::plan::MAX_ALL_TO_ALL_GROUPS)?;
    let t = &timelines[groups as usize - 1].1;
    // On NCCL, as for its AllReduce and ReduceScatter, overlap must win by
    // the model's error: at 16384x8192x14336 its 22 groups were predicted
    // 3% under the sequential schedule and measured 6% over it (2x H200
    // E2, 2026-11-26).
    let margin = match opts.backend {
        Backend::Nccl => crate::plan::gemm_all_reduce::AUTO_OVERLAP_MARGIN,
        _ => 1.0,
    };
    let sequential = call_us(groups, t, hw.overlap_fixed_us) >= margin * t.sequential_us;
    Ok(GroupChoice {
        groups,
        sequential,
        timelines,
        fixed_us: hw.overlap_fixed_us,
    })
}

/// The tables the kernel reads, as one block of u32 words for the caller
/// to upload: tile order, group per position, then (row of x read, row of
/// the send buffer written) per position. `pushed_by`: the push backend's
/// (rank, send_splits): the tiles of the peer's rows store into its slot
/// (the plan's layout natural, as plan_for makes it for push).
pub fn tables(
    plan: &AllToAllPlan,
    kernel: GemmKernel,
    pushed_by: Option<(u32, &[u64])>,
) -> Vec<u32> {
    let mut words = Vec::with_capacity(plan.tile_order.len() * 4);
    words.extend(&plan.tile_order);
    words.extend(&plan.tile_group);
    let store_rows = match pushed_by {
        Some((me, sends)) => {
            pushed_store_rows(plan, me, sends, u64::from(gemm::tile_shape(kernel).bm))
        }
        None => plan.store_rows.clone(),
    };
    words.extend(gemm::row_table(&plan.load_rows, &store_rows));
    words
}

/// What the caller provides on the device, in stream order on its stream:
/// the send buffer, the uploaded [`tables`] and one zeroed counter per group.
#[derive(Debug, Clone, Copy)]
pub struct Buffers {
    pub send: u64,
    pub send_rows: u64,
    pub tables: u64,
    pub table_words: u64,
    pub counters: u64,
}

/// Enqueues the op into `args.out` ([sum(recv_splits), N]). Every rank
/// calls it with the same group count; the splits are those of
/// all_to_all_single. `matrix`: the whole routing where known (the natural
/// layout, see [`plan_for`]).
#[allow(clippy::too_many_arguments)]
pub fn gemm_all_to_all(
    comm: &Communicator,
    args: &GemmArgs,
    send_splits: &[u64],
    recv_splits: &[u64],
    matrix: Option<&[Vec<u64>]>,
    buffers: &Buffers,
    opts: &Options,
    caller: RawStream,
) -> Result<()> {
    driver::bind(comm.device.ordinal)?;
    let world = comm.world as usize;
    if send_splits.len() != world || recv_splits.len() != world {
        return Err(Error::Invalid(format!(
            "input_split_sizes / output_split_sizes: need {world} entries each, got {} and {}",
            send_splits.len(),
            recv_splits.len()
        )));
    }
    let me = comm.rank as usize;
    let routing = matrix.map(|matrix| Routing { matrix, me });
    let (kernel, plan) = plan_for(
        args,
        send_splits,
        recv_splits,
        routing,
        opts,
        comm.device.sms,
        comm.device.major,
    )?;
    let positions = plan.tile_order.len() as u64;
    if plan.send_buffer_rows > buffers.send_rows
        || buffers.table_words < positions * 4
        || (positions > 0 && (buffers.send == 0 || buffers.tables == 0))
        || buffers.counters == 0
    {
        return Err(Error::Invalid(format!(
            "internal: buffers {buffers:?} do not fit the plan ({} send rows, {positions} positions)",
            plan.send_buffer_rows
        )));
    }
    let loaded = gemm::load(&comm.device, args.dtype, kernel)?;
    let signals = Signals {
        tile_order: buffers.tables,
        tile_group: buffers.tables + positions * 4,
        counters: buffers.counters,
        row_table: buffers.tables + positions * 8,
        store: buffers.send,
        store_rows: plan.send_buffer_rows as u32,
        tile_count: positions as u32,
        ..Signals::default()
    };
    let ctas = opts.ctas(comm.device.sms);
    // No position: this rank computes no row (it may still receive some).
    let prepare = |signals: &Signals| {
        (positions > 0)
            .then(|| gemm::prepare(&loaded, args, signals, ctas))
            .transpose()
    };
    match opts.backend {
        Backend::Peer => Err(Backend::peer_unsupported("gemm_all_to_all")),
        Backend::Nccl => {
            let gemm = prepare(&signals)?;
            let launch = || gemm.map_or(Ok(()), |g| g.enqueue(caller));
            enqueue_nccl(comm, &plan, args, buffers, caller, launch)
        }
        Backend::Push | Backend::CopyEngine => {
            let bm = u64::from(gemm::tile_shape(kernel).bm);
            let pushed = opts.backend == Backend::Push;
            // plan_for made push's layout from the matrix.
            let push = matrix.filter(|_| pushed).map(|m| (bm, m));
            let groups = moves(
                &plan,
                args,
                buffers.send,
                me,
                send_splits,
                recv_splits,
                push,
            );
            copy_engine::check_groups(&groups)?;
            if !pushed {
                comm.ensure_group_events(groups.len())?;
            }
            let peer = copy_engine::peer_buffers(comm, &groups)?;
            let push_rows = if pushed {
                Some(check_slot_rows(
                    comm,
                    &peer,
                    args,
                    &plan,
                    send_splits,
                    recv_splits,
                    bm,
                )?)
            } else {
                None
            };
            let call = copy_engine::Call {
                peer: &peer,
                reducer: None,
                signals: Some(&signals),
                groups: &groups,
                reduce_ctas: 0,
            };
            copy_engine::enqueue_gemm(comm, &call, caller, push_rows, prepare, |_, _| Ok(()))
        }
    }
}

/// The rows of the peer's slot a pushed call's GEMM stores into (whole
/// bands; at least one, which the slot's tensor map needs), checked against
/// the slots both ways.
fn check_slot_rows(
    comm: &Communicator,
    peer: &PeerBuffers,
    args: &GemmArgs,
    plan: &AllToAllPlan,
    send_splits: &[u64],
    recv_splits: &[u64],
    bm: u64,
) -> Result<u32> {
    let other = 1 - comm.rank as usize;
    let push_rows = pushed_slot_rows(send_splits[other], plan.send_phases[other], bm).max(bm);
    let rows = push_rows.max(pushed_slot_rows(
        recv_splits[other],
        plan.recv_phases[other],
        bm,
    ));
    let needs = rows * u64::from(args.n) * args.dtype.bytes() as u64;
    if peer.layout.slot_bytes < needs {
        return Err(Error::Invalid(format!(
            "backend: the push All-to-All needs {needs} bytes per slot, communicator {:?} has {}; \
             the flashoverlap ops grow them (collectively) before the call",
            comm.name, peer.layout.slot_bytes
        )));
    }
    u32::try_from(push_rows)
        .map_err(|_| Error::Invalid(format!("backend: {push_rows} pushed rows, more than 2**32")))
}

/// Each group's exchange on the copy engines: the rows for peer p go to
/// p's slot for this rank at their offset among all rows this rank sends p
/// (the same offset p computes among all rows it receives from this rank:
/// both split the same count into the same parts); this rank's own rows go
/// straight from the send buffer to the output. `push`: the push backend's
/// tile rows and the whole routing (the plan natural): no sends (the GEMM
/// pushes), the rows land from where [`pushed_store_rows`] put them (the
/// block's phase plus its index), and each group waits for the tiles the
/// peer's GEMM pushes in it ([`pushed_tiles`]).
fn moves(
    plan: &AllToAllPlan,
    args: &GemmArgs,
    send: u64,
    me: usize,
    send_splits: &[u64],
    recv_splits: &[u64],
    push: Option<(u64, &[Vec<u64>])>,
) -> Vec<Group> {
    let row = u64::from(args.n) * args.dtype.bytes() as u64;
    let count = plan.groups.len() as u32;
    // [peer][group]: the tiles peer pushes to this rank.
    let pushed_counts: Vec<Vec<u32>> = match push {
        Some((bm, matrix)) => matrix
            .iter()
            .map(|sends| pushed_tiles(sends, me, count, bm, plan.tiles_n))
            .collect(),
        None => Vec::new(),
    };
    plan.groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let g = g as u32;
            let mut m = Moves {
                tiles: group.tiles,
                sends: Vec::new(),
                lands: Vec::new(),
                own: (0, 0, 0),
                pushed: 0,
            };
            for e in &group.exchanges {
                let p = e.peer as usize;
                if p == me {
                    m.own = (
                        send + e.send_row * row,
                        args.out + e.recv_row * row,
                        e.recv_rows * row,
                    );
                    continue;
                }
                let landed_at = match push {
                    Some(_) => {
                        m.pushed += pushed_counts[p][g as usize];
                        plan.recv_phases[p] + plan.recv_part(recv_splits, p, g)
                    }
                    None => {
                        m.sends.push(Piece {
                            rank: p,
                            addr: send + e.send_row * row,
                            bytes: e.send_rows * row,
                            slot_offset: plan.send_part(send_splits, p, g) * row,
                        });
                        plan.recv_part(recv_splits, p, g)
                    }
                };
                m.lands.push(Piece {
                    rank: p,
                    addr: args.out + e.recv_row * row,
                    bytes: e.recv_rows * row,
                    slot_offset: landed_at * row,
                });
            }
            Group::Move(m)
        })
        .collect()
}

fn enqueue_nccl(
    comm: &Communicator,
    plan: &AllToAllPlan,
    args: &GemmArgs,
    buffers: &Buffers,
    caller: RawStream,
    launch_gemm: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let (nccl, nccl_comm) = comm.nccl()?;
    let row_bytes = u64::from(args.n) * args.dtype.bytes() as u64;
    let comm_stream = comm.stream.0;
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    comm.fork.order(caller, comm_stream)?;
    launch_gemm()?;
    let n = args.n as usize;
    for (g, group) in plan.groups.iter().enumerate() {
        stream::wait_geq(comm_stream, buffers.counters + (g * 4) as u64, group.tiles)?;
        let sends: Vec<(u64, usize, i32)> = group
            .exchanges
            .iter()
            .map(|e| {
                (
                    buffers.send + e.send_row * row_bytes,
                    e.send_rows as usize * n,
                    e.peer as i32,
                )
            })
            .collect();
        let recvs: Vec<(u64, usize, i32)> = group
            .exchanges
            .iter()
            .map(|e| {
                (
                    args.out + e.recv_row * row_bytes,
                    e.recv_rows as usize * n,
                    e.peer as i32,
                )
            })
            .collect();
        nccl.exchange(&sends, &recvs, args.dtype, nccl_comm, comm_stream.cast())?;
    }
    comm.join.order(comm_stream, caller)
}

/// A plain uniform All-to-All on the communicator's stream: `count`
/// elements from every rank to every rank (what `tune` times for the
/// predictor's curve), ordered after the caller's prior work.
pub fn all_to_all(
    comm: &Communicator,
    send: u64,
    recv: u64,
    count: usize,
    dtype: Dtype,
    caller: RawStream,
) -> Result<()> {
    if (send == 0 || recv == 0) && count > 0 {
        return Err(Error::Invalid("tensor: null device pointer".into()));
    }
    let bytes = count as u64 * u64::from(dtype.bytes());
    let part = |base: u64| -> Vec<(u64, usize, i32)> {
        (0..comm.world)
            .map(|p| (base + p as u64 * bytes, count, p))
            .collect()
    };
    let (sends, recvs) = (part(send), part(recv));
    comm.on_comm_stream(caller, |nccl, nccl_comm, stream| {
        nccl.exchange(&sends, &recvs, dtype, nccl_comm, stream.cast())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::MAX_TABLE_ROWS;

    fn args(m: u32) -> GemmArgs {
        GemmArgs {
            x: 0,
            weight: 0,
            out: 1 << 40,
            m,
            n: 1024,
            k: 512,
            dtype: Dtype::Bf16,
        }
    }

    fn opts(backend: Backend, kernel: Option<GemmKernel>) -> Options {
        Options {
            kernel,
            groups: 3,
            reserved_sms: None,
            backend,
        }
    }

    /// On 2 ranks the push backend's landings read slot rows the peer's
    /// tables pushed in that group or before, and each group waits for as
    /// many tiles as the peer's GEMM pushes in it.
    #[test]
    fn pushed_rows_are_what_the_peer_lands() {
        // Skewed, with an empty pair (rank 1 sends rank 0 nothing), and the
        // bench's skew (a band on each rank holding rows of both).
        for matrix in [
            vec![vec![300u64, 1700], vec![0, 900]],
            vec![vec![819, 1229], vec![819, 1229]],
        ] {
            let recv = |r: usize| vec![matrix[0][r], matrix[1][r]];
            let push = opts(Backend::Push, None);
            let row = 1024 * 2;
            let planned: Vec<_> = (0..2)
                .map(|r| {
                    let a = args(matrix[r].iter().sum::<u64>() as u32);
                    let routing = Routing {
                        matrix: &matrix,
                        me: r,
                    };
                    let (kernel, plan) =
                        plan_for(&a, &matrix[r], &recv(r), Some(routing), &push, 132, 9).unwrap();
                    let table = tables(&plan, kernel, Some((r as u32, &matrix[r][..])));
                    (a, plan, table)
                })
                .collect();
            for me in 0..2usize {
                let peer = 1 - me;
                let (a, plan, _) = &planned[me];
                let push = Some((128, &matrix[..]));
                let groups = moves(plan, a, 1 << 30, me, &matrix[me], &recv(me), push);
                // The slot rows the peer pushed by the end of each group.
                let (_, peer_plan, peer_table) = &planned[peer];
                let positions = peer_plan.tile_order.len();
                let stores = &peer_table[positions * 2..];
                let mut filled = Vec::new();
                for (g, group) in groups.iter().enumerate() {
                    let Group::Move(m) = group else {
                        panic!("an All-to-All group moves")
                    };
                    assert!(m.sends.is_empty(), "the GEMM pushes, nothing is copied out");
                    let pushed: Vec<u64> = peer_plan.groups[g]
                        .positions
                        .clone()
                        .filter_map(|p| {
                            let stored = stores[2 * p as usize + 1] as i32;
                            (stored < 0).then_some(!stored as u64 & (MAX_TABLE_ROWS - 1))
                        })
                        .collect();
                    assert_eq!(m.pushed as usize, pushed.len(), "group {g}");
                    filled.extend(pushed.iter().flat_map(|&r| r..r + 128));
                    for l in m.lands.iter().filter(|l| l.rank == peer && l.bytes > 0) {
                        let (from, to) = (l.slot_offset / row, (l.slot_offset + l.bytes) / row);
                        assert!((from..to).all(|r| filled.contains(&r)), "group {g}");
                    }
                }
            }
        }
    }

    #[test]
    fn push_needs_two_hopper_ranks_and_the_sm90_kernel() {
        let a = args(100);
        let push = opts(Backend::Push, None);
        let matrix = [vec![50, 50], vec![10, 90]];
        let routing = Some(Routing {
            matrix: &matrix,
            me: 0,
        });
        assert!(plan_for(&a, &[50, 50], &[50, 10], routing, &push, 132, 9).is_ok());
        // Its layout is made from the whole routing.
        let e = plan_for(&a, &[50, 50], &[50, 10], None, &push, 132, 9).unwrap_err();
        assert!(e.to_string().contains("split_matrix"), "{e}");
        let nccl = opts(Backend::Nccl, None);
        let (_, plan) = plan_for(&a, &[50, 50], &[50, 10], routing, &nccl, 132, 9).unwrap();
        assert_eq!(
            (
                plan.send_phases.clone(),
                plan.recv_phases.clone(),
                plan.send_buffer_rows
            ),
            (vec![0, 50], vec![0, 0], 128)
        );
        for (sends, recvs, major, kernel) in [
            (&[50u64, 25, 25][..], &[1u64, 1, 1][..], 9, None),
            (&[50, 50], &[10, 10], 8, None),
            (&[50, 50], &[10, 10], 9, Some(GemmKernel::Sm80)),
        ] {
            let e = plan_for(
                &a,
                sends,
                recvs,
                routing,
                &opts(Backend::Push, kernel),
                132,
                major,
            )
            .unwrap_err();
            assert!(e.to_string().contains("backend: 'push'"), "{e}");
        }
        let e = plan_for(
            &a,
            &[50, 50],
            &[10, 10],
            None,
            &opts(Backend::Peer, None),
            132,
            9,
        )
        .unwrap_err();
        assert!(e.to_string().contains("'peer'"), "{e}");
    }
}
