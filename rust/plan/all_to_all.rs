//! GEMM + All-to-All (the expert-parallel combine): y = x @ w^T with x's
//! rows grouped by destination rank (`send_splits`), and rank r receiving
//! from peer p its rows into out rows starting at sum(recv_splits[..p]), as
//! torch.distributed.all_to_all_single does.
//!
//! Wave group g takes the same fraction of every destination's rows: of the
//! B_d = ceil(S_d / 128) bands of destination d's region, bands
//! [B_d*g/G, B_d*(g+1)/G) (the last band may be partial), so every link
//! carries a share of every group and the receiver, computing the same
//! split of what it gets from each peer, knows where each group's rows
//! land. Every rank must therefore use the same group count G; it is part
//! of the call, not chosen per rank (ranks carry different amounts).
//!
//! Each (group, destination) segment is tiled on its own, in whole bands of
//! a send buffer (a band's rows past the segment's end are computed and
//! never sent), so the GEMM's stores of one segment never touch another's
//! and each send is one contiguous block. Segments are whole bands except a
//! destination's last, so the GEMM computes at most one partial band per
//! destination whatever G is (near-equal row splits padded every segment:
//! up to G extra bands per destination, 2x the tiles at T = 2048, G = 16).
//!
//! That partial band still costs: 819 + 1229 rows are 17 bands where 2048
//! are 16, a third wave on 128 CTAs at N = 4096. Where every rank knows the
//! whole routing (the split matrix), the plan is *natural* instead: the
//! send buffer is x's row order, tiled on one grid of bands, and each
//! destination's parts are whole bands of that grid (its first and last may
//! be partial), so the GEMM computes exactly ceil(T / 128) bands, as cuBLAS
//! would. A band shared by two destinations is computed in the earlier of
//! the groups that need it; the exchanges wait for the groups' counters in
//! order, so a group's rows are all computed before it is sent. The
//! receiver needs the phase of its block in each sender's grid (where it
//! starts, mod 128), which the matrix gives.

use super::error::PlanError;
use super::tiles::{dual_row, pushed_row, TileShape, MAX_TABLE_ROWS};

/// One (group, peer) exchange: the rows sent from the send buffer and the
/// rows received into the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    pub peer: u32,
    pub send_row: u64,
    pub send_rows: u64,
    pub recv_row: u64,
    pub recv_rows: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllToAllGroup {
    pub positions: std::ops::Range<u32>,
    pub tiles: u32,
    pub exchanges: Vec<Exchange>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllToAllPlan {
    pub groups: Vec<AllToAllGroup>,
    /// Per position: tile id (band * tiles_n + tn over the send buffer's
    /// bands), the row of x read, the row of the send buffer written.
    pub tile_order: Vec<u32>,
    pub load_rows: Vec<u32>,
    pub store_rows: Vec<u32>,
    pub tile_group: Vec<u32>,
    /// Rows of the send buffer (whole bands per segment).
    pub send_buffer_rows: u64,
    pub tiles_n: u32,
    /// Natural layout: where each destination's block starts on this rank's
    /// band grid, and this rank's block on each sender's (mod
    /// SEGMENT_ROWS); all zero in the padded layout.
    pub send_phases: Vec<u64>,
    pub recv_phases: Vec<u64>,
}

impl AllToAllPlan {
    /// Rows into destination d's block where group g's part starts.
    pub fn send_part(&self, sends: &[u64], d: usize, g: u32) -> u64 {
        part_phased(sends[d], self.send_phases[d], g, self.groups.len() as u32)
    }

    fn empty(
        groups: u32,
        tiles_n: u32,
        send_buffer_rows: u64,
        send_phases: Vec<u64>,
        recv_phases: Vec<u64>,
    ) -> Self {
        Self {
            groups: Vec::with_capacity(groups as usize),
            tile_order: Vec::new(),
            load_rows: Vec::new(),
            store_rows: Vec::new(),
            tile_group: Vec::new(),
            send_buffer_rows,
            tiles_n,
            send_phases,
            recv_phases,
        }
    }

    /// Every tile of band `band` (its id's band), reading x from row `load`
    /// and storing to send-buffer row `store`, in group g.
    fn push_band(&mut self, band: u32, load: u64, store: u64, g: u32) {
        for tn in 0..self.tiles_n {
            self.tile_order.push(band * self.tiles_n + tn);
            self.load_rows.push(load as u32);
            self.store_rows.push(store as u32);
            self.tile_group.push(g);
        }
    }

    /// Ends the group whose tiles start at position `first`.
    fn close_group(&mut self, first: u32, exchanges: Vec<Exchange>) {
        let end = self.tile_order.len() as u32;
        self.groups.push(AllToAllGroup {
            positions: first..end,
            tiles: end - first,
            exchanges,
        });
    }

    /// The same plan with each group walked in blocks of `bands` of its row
    /// bands (in the group's band order), column by column inside a block,
    /// as plan::order's rastered order does for the AllReduce. Row by row, a
    /// wave of 132 CTAs at N = 8192 spans ~4 bands and every tile column, so
    /// each wave streams all of w through L2 (235 MB at K = 14336): the
    /// overlapped GEMM ran 1.4-1.6x cuBLAS's time there on 2x H100. Groups
    /// keep their positions; only the order inside one changes. `bands` = 1:
    /// unchanged.
    pub fn rastered(mut self, bands: u32) -> Self {
        let tiles_n = self.tiles_n as usize;
        if bands <= 1 || tiles_n == 0 {
            return self;
        }
        let mut from = Vec::with_capacity(self.tile_order.len());
        for group in &self.groups {
            let first = group.positions.start as usize;
            // Every group is whole bands of tiles_n positions (push_band).
            let entries = group.tiles as usize / tiles_n;
            let mut block = 0;
            while block < entries {
                let end = (block + bands as usize).min(entries);
                for tn in 0..tiles_n {
                    from.extend((block..end).map(|i| first + i * tiles_n + tn));
                }
                block = end;
            }
        }
        let permute = |v: &[u32]| from.iter().map(|&i| v[i]).collect::<Vec<u32>>();
        self.tile_order = permute(&self.tile_order);
        self.load_rows = permute(&self.load_rows);
        self.store_rows = permute(&self.store_rows);
        self.tile_group = permute(&self.tile_group);
        self
    }

    /// Rows into what sender p sends this rank where group g's part starts.
    pub fn recv_part(&self, recvs: &[u64], p: usize, g: u32) -> u64 {
        part_phased(recvs[p], self.recv_phases[p], g, self.groups.len() as u32)
    }
}

/// How the sender tiles its rows (see the module's header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout<'a> {
    /// Each (group, destination) segment on its own whole bands.
    Padded,
    /// One grid over x's rows; `recv_phases[p]`: where this rank's block
    /// starts in sender p's rows, mod SEGMENT_ROWS.
    Natural { recv_phases: &'a [u64] },
}

/// The rows a segment is made of (the last of a destination may be
/// partial): a multiple of every kernel's tile height, and fixed, so that a
/// receiver computes the sender's split without knowing its kernel.
pub const SEGMENT_ROWS: u64 = 128;

/// The start of part g of `rows` split in `groups` parts of near-equal
/// counts of whole SEGMENT_ROWS bands (a part may be empty).
pub(crate) fn part(rows: u64, g: u32, groups: u32) -> u64 {
    part_on(rows, 0, SEGMENT_ROWS, g, groups)
}

/// The start of part g of `rows` that begin `phase` rows into a band of
/// SEGMENT_ROWS: near-equal counts of whole bands of that grid, the first
/// and last partial (phase 0: [`part`]).
pub(crate) fn part_phased(rows: u64, phase: u64, g: u32, groups: u32) -> u64 {
    part_on(rows, phase, SEGMENT_ROWS, g, groups)
}

/// The split behind [`part`] and [`part_phased`], on a grid of `unit`-row
/// bands; unit 1 (phase 0) gives the near-equal row split the op used
/// before its segments were whole bands (what the predictor needs to replay
/// runs measured then).
pub(crate) fn part_on(rows: u64, phase: u64, unit: u64, g: u32, groups: u32) -> u64 {
    let bands = (phase + rows).div_ceil(unit);
    (bands * u64::from(g) / u64::from(groups) * unit)
        .saturating_sub(phase)
        .min(rows)
}

/// Running starts of `splits` (each block's first row).
fn offsets(splits: &[u64]) -> Vec<u64> {
    splits
        .iter()
        .scan(0, |o, &s| {
            let start = *o;
            *o += s;
            Some(start)
        })
        .collect()
}

/// Where each destination's block starts on a sender's band grid (mod
/// SEGMENT_ROWS) when its rows are in x's order.
pub fn natural_phases(sends: &[u64]) -> Vec<u64> {
    offsets(sends).iter().map(|o| o % SEGMENT_ROWS).collect()
}

/// The natural layout's `recv_phases` of rank `me` from the split matrix
/// (`matrix[p][q]`: rows p sends q): where its block starts in each
/// sender's rows, mod SEGMENT_ROWS.
pub fn recv_phases(matrix: &[Vec<u64>], me: usize) -> Result<Vec<u64>, PlanError> {
    let world = matrix.len();
    if me >= world || matrix.iter().any(|row| row.len() != world) {
        return Err(PlanError::InvalidShape(format!(
            "split_matrix must be world x world with rank {me} in it, got {world} rows of lengths {:?}",
            matrix.iter().map(Vec::len).collect::<Vec<_>>()
        )));
    }
    Ok(matrix.iter().map(|row| natural_phases(row)[me]).collect())
}

/// The natural layout's bands of `bm` rows in each group of a sender of
/// `sends`: group g computes the bands of its parts of every destination
/// that no earlier group computed (a band two destinations share goes to
/// the earlier of their groups).
pub fn natural_bands(sends: &[u64], groups: u32, bm: u64) -> Vec<Vec<u64>> {
    let mut bands = vec![Vec::new(); groups as usize];
    each_natural_band(sends, groups, bm, |g, band| bands[g as usize].push(band));
    bands
}

/// How many of [`natural_bands`] each group computes, without listing them
/// (the predictor's search asks for every group count on every call).
pub fn natural_band_counts(sends: &[u64], groups: u32, bm: u64) -> Vec<u64> {
    let mut counts = vec![0; groups as usize];
    each_natural_band(sends, groups, bm, |g, _| counts[g as usize] += 1);
    counts
}

/// Calls `visit(g, band)` for each of [`natural_bands`], groups in order.
fn each_natural_band(sends: &[u64], groups: u32, bm: u64, mut visit: impl FnMut(u32, u64)) {
    let total: u64 = sends.iter().sum();
    let (starts, phases) = (offsets(sends), natural_phases(sends));
    let mut taken = vec![false; total.div_ceil(bm) as usize];
    for g in 0..groups {
        for (d, &rows) in sends.iter().enumerate() {
            let a = part_phased(rows, phases[d], g, groups);
            let b = part_phased(rows, phases[d], g + 1, groups);
            if b == a {
                continue;
            }
            for band in (starts[d] + a) / bm..(starts[d] + b).div_ceil(bm) {
                if !std::mem::replace(&mut taken[band as usize], true) {
                    visit(g, band);
                }
            }
        }
    }
}

fn check_splits(name: &str, splits: &[u64], world: u32) -> Result<(), PlanError> {
    if splits.len() != world as usize {
        return Err(PlanError::InvalidShape(format!(
            "{name} must have one entry per rank ({world}), got {}",
            splits.len()
        )));
    }
    Ok(())
}

/// Plans the exchange of `send_splits` rows (summing to x's rows) to each
/// peer and `recv_splits` rows from each, in `groups` groups, for `n`
/// output columns and tiles of `tile`, in `layout`.
pub fn plan_gemm_all_to_all(
    send_splits: &[u64],
    recv_splits: &[u64],
    n: u32,
    tile: TileShape,
    groups: u32,
    layout: Layout,
) -> Result<AllToAllPlan, PlanError> {
    let world = send_splits.len() as u32;
    if world == 0 {
        return Err(PlanError::InvalidShape(
            "send_splits must have one entry per rank, got none".into(),
        ));
    }
    check_splits("recv_splits", recv_splits, world)?;
    if groups == 0 {
        return Err(PlanError::InvalidPartition(
            "groups must be >= 1, got 0".into(),
        ));
    }
    if tile.bm == 0 || SEGMENT_ROWS % u64::from(tile.bm) != 0 {
        return Err(PlanError::InvalidShape(format!(
            "tile height {} must divide the All-to-All's segment bands of {SEGMENT_ROWS} rows",
            tile.bm
        )));
    }
    let tiles_n = n.div_ceil(tile.bn);
    let bm = u64::from(tile.bm);
    let (send_offsets, recv_offsets) = (offsets(send_splits), offsets(recv_splits));
    if let Layout::Natural { recv_phases } = layout {
        check_splits("recv_phases", recv_phases, world)?;
        if let Some(p) = recv_phases.iter().find(|&&p| p >= SEGMENT_ROWS) {
            return Err(PlanError::InvalidShape(format!(
                "recv_phases must be below {SEGMENT_ROWS}, got {p}"
            )));
        }
        return natural_plan(send_splits, recv_splits, recv_phases, tiles_n, bm, groups);
    }
    let zeros = vec![0; world as usize];
    let mut plan = AllToAllPlan::empty(groups, tiles_n, 0, zeros.clone(), zeros);
    for g in 0..groups {
        let first = plan.tile_order.len() as u32;
        let mut exchanges = Vec::with_capacity(world as usize);
        for p in 0..world as usize {
            let (s0, s1) = (
                part(send_splits[p], g, groups),
                part(send_splits[p], g + 1, groups),
            );
            let (r0, r1) = (
                part(recv_splits[p], g, groups),
                part(recv_splits[p], g + 1, groups),
            );
            let send_row = plan.send_buffer_rows;
            let bands = (s1 - s0).div_ceil(bm);
            for j in 0..bands {
                let band = (send_row / bm + j) as u32;
                let load = send_offsets[p] + s0 + j * bm;
                let store = send_row + j * bm;
                if load >= MAX_TABLE_ROWS || store + bm > MAX_TABLE_ROWS {
                    return Err(PlanError::InvalidShape(
                        "rows must stay below 2**30 for the kernel's row table".into(),
                    ));
                }
                plan.push_band(band, load, store, g);
            }
            plan.send_buffer_rows += bands * bm;
            exchanges.push(Exchange {
                peer: p as u32,
                send_row,
                send_rows: s1 - s0,
                recv_row: recv_offsets[p] + r0,
                recv_rows: r1 - r0,
            });
        }
        plan.close_group(first, exchanges);
    }
    Ok(plan)
}

/// The natural layout (see the module's header): tiles on one grid of x's
/// rows, stored in place into a send buffer in x's row order.
fn natural_plan(
    send_splits: &[u64],
    recv_splits: &[u64],
    recv_phases: &[u64],
    tiles_n: u32,
    bm: u64,
    groups: u32,
) -> Result<AllToAllPlan, PlanError> {
    let total: u64 = send_splits.iter().sum();
    let bands_total = total.div_ceil(bm);
    if bands_total * bm > MAX_TABLE_ROWS {
        return Err(PlanError::InvalidShape(
            "rows must stay below 2**30 for the kernel's row table".into(),
        ));
    }
    let (send_offsets, recv_offsets) = (offsets(send_splits), offsets(recv_splits));
    let mut plan = AllToAllPlan::empty(
        groups,
        tiles_n,
        bands_total * bm,
        natural_phases(send_splits),
        recv_phases.to_vec(),
    );
    let bands = natural_bands(send_splits, groups, bm);
    for (g, group_bands) in (0..groups).zip(&bands) {
        let first = plan.tile_order.len() as u32;
        for &band in group_bands {
            plan.push_band(band as u32, band * bm, band * bm, g);
        }
        let part = |splits: &[u64], phases: &[u64], p: usize, g: u32| {
            part_phased(splits[p], phases[p], g, groups)
        };
        let exchanges = (0..send_splits.len())
            .map(|p| {
                let (s0, s1) = (
                    part(send_splits, &plan.send_phases, p, g),
                    part(send_splits, &plan.send_phases, p, g + 1),
                );
                let (r0, r1) = (
                    part(recv_splits, recv_phases, p, g),
                    part(recv_splits, recv_phases, p, g + 1),
                );
                Exchange {
                    peer: p as u32,
                    send_row: send_offsets[p] + s0,
                    send_rows: s1 - s0,
                    recv_row: recv_offsets[p] + r0,
                    recv_rows: r1 - r0,
                }
            })
            .collect();
        plan.close_group(first, exchanges);
    }
    Ok(plan)
}

/// The push layout (2 ranks, natural layout): the sender's GEMM stores each
/// band holding rows of the receiver's block into the receiver's slot for
/// it, whole, at the band's row on the sender's grid counted from the band
/// that holds the block's first row. The block's rows then sit at slot rows
/// phase..phase + rows (phase: where it starts in that band, the
/// receiver's `recv_phases` entry), and the rows around them (the sender's
/// own, or past its last) are never read. A band also holding the sender's
/// own rows is stored here too ([`dual_row`]). Slot rows the block of
/// `rows` fills, starting `phase` rows into a band of `bm`:
pub fn pushed_slot_rows(rows: u64, phase: u64, bm: u64) -> u64 {
    if rows == 0 {
        0
    } else {
        (phase + rows).div_ceil(bm) * bm
    }
}

/// The store rows of the natural `plan` of rank `me` (of 2, sending
/// `sends`) when its GEMM pushes: a band of the peer's rows only goes to
/// the peer's slot ([`pushed_row`]), one of both ranks' rows goes there and
/// here ([`dual_row`]), one of this rank's rows only stays here.
pub fn pushed_store_rows(plan: &AllToAllPlan, me: u32, sends: &[u64], bm: u64) -> Vec<u32> {
    let peer = 1 - me as usize;
    let (start, rows) = (offsets(sends)[peer], sends[peer]);
    let total: u64 = sends.iter().sum();
    let first = start / bm * bm;
    plan.store_rows
        .iter()
        .map(|&stored| {
            // Natural: every band is stored at its own rows (x's order).
            let (lo, hi) = (u64::from(stored), (u64::from(stored) + bm).min(total));
            let theirs = holds(lo..hi, start, rows);
            let mine = lo < start || hi > start + rows;
            match (theirs, mine) {
                (true, true) => dual_row(lo - first),
                (true, false) => pushed_row(lo - first),
                _ => stored,
            }
        })
        .collect()
}

/// Whether rows `band` hold any of the `rows` rows from `start`.
fn holds(band: std::ops::Range<u64>, start: u64, rows: u64) -> bool {
    rows > 0 && band.start < start + rows && start < band.end
}

/// Tiles the GEMM of a rank sending `sends` (natural layout, `groups`
/// groups, `tiles_n` tiles per band of `bm`) pushes to rank `dest` in each
/// group: the bands holding dest's rows, each in the group computing it.
pub fn pushed_tiles(sends: &[u64], dest: usize, groups: u32, bm: u64, tiles_n: u32) -> Vec<u32> {
    let (start, rows) = (offsets(sends)[dest], sends[dest]);
    natural_bands(sends, groups, bm)
        .iter()
        .map(|bands| {
            let held = bands
                .iter()
                .filter(|&&b| holds(b * bm..(b + 1) * bm, start, rows))
                .count();
            held as u32 * tiles_n
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::TILE;

    /// Every rank's plan for a random split matrix: what p sends r in group
    /// g is what r expects from p in group g, every sent row is computed by
    /// exactly one tile, and every received row lands once.
    fn check_world(matrix: &[Vec<u64>], groups: u32, raster: u32) -> Result<(), TestCaseError> {
        let world = matrix.len();
        let plans: Vec<AllToAllPlan> = (0..world)
            .map(|r| {
                let recv: Vec<u64> = (0..world).map(|p| matrix[p][r]).collect();
                plan_gemm_all_to_all(&matrix[r], &recv, 200, TILE, groups, Layout::Padded)
                    .unwrap()
                    .rastered(raster)
            })
            .collect();
        for (r, plan) in plans.iter().enumerate() {
            prop_assert_eq!(plan.groups.len() as u32, groups);
            let rows: u64 = matrix[r].iter().sum();
            let mut computed = vec![0u32; rows as usize];
            for p in 0..plan.tile_order.len() {
                if plan.tile_order[p] % plan.tiles_n != 0 {
                    continue;
                }
                let g = &plan.groups[plan.tile_group[p] as usize];
                prop_assert!(g.positions.contains(&(p as u32)));
                let e = g
                    .exchanges
                    .iter()
                    .find(|e| {
                        (e.send_row..e.send_row + e.send_rows.div_ceil(128) * 128)
                            .contains(&u64::from(plan.store_rows[p]))
                    })
                    .expect("a tile stores inside one segment");
                for i in 0..128u64 {
                    let at = u64::from(plan.store_rows[p]) + i;
                    if at < e.send_row + e.send_rows {
                        computed[(u64::from(plan.load_rows[p]) + i) as usize] += 1;
                    }
                }
            }
            prop_assert!(computed.iter().all(|&c| c == 1));
            let mut received = vec![0u32; (0..world).map(|p| matrix[p][r]).sum::<u64>() as usize];
            for (g, group) in plan.groups.iter().enumerate() {
                for e in &group.exchanges {
                    let peer = &plans[e.peer as usize].groups[g].exchanges[r];
                    prop_assert_eq!(peer.send_rows, e.recv_rows);
                    for row in e.recv_row..e.recv_row + e.recv_rows {
                        received[row as usize] += 1;
                    }
                }
            }
            prop_assert!(received.iter().all(|&c| c == 1));
        }
        Ok(())
    }

    /// The natural layout on every rank of a split matrix: x's rows tiled
    /// once each (ceil(T / 128) bands, stored in place), a row sent in group
    /// g computed in a group <= g, what p sends r in group g is what r
    /// expects, each destination's block sent once, every received row
    /// landing once.
    fn check_natural(matrix: &[Vec<u64>], groups: u32, raster: u32) -> Result<(), TestCaseError> {
        let world = matrix.len();
        let plans: Vec<AllToAllPlan> = (0..world)
            .map(|r| {
                let recv: Vec<u64> = (0..world).map(|p| matrix[p][r]).collect();
                let phases = recv_phases(matrix, r).unwrap();
                let layout = Layout::Natural {
                    recv_phases: &phases,
                };
                plan_gemm_all_to_all(&matrix[r], &recv, 200, TILE, groups, layout)
                    .unwrap()
                    .rastered(raster)
            })
            .collect();
        for (r, plan) in plans.iter().enumerate() {
            let rows: u64 = matrix[r].iter().sum();
            let bands = rows.div_ceil(128);
            prop_assert_eq!(
                plan.tile_order.len() as u64,
                bands * u64::from(plan.tiles_n)
            );
            prop_assert_eq!(plan.send_buffer_rows, bands * 128);
            // Row -> the group whose tile computes it.
            let mut computed_in = vec![None; rows as usize];
            for p in 0..plan.tile_order.len() {
                prop_assert_eq!(plan.load_rows[p], plan.store_rows[p]);
                prop_assert!(plan.groups[plan.tile_group[p] as usize]
                    .positions
                    .contains(&(p as u32)));
                if plan.tile_order[p] % plan.tiles_n != 0 {
                    continue;
                }
                for row in
                    u64::from(plan.load_rows[p])..(u64::from(plan.load_rows[p]) + 128).min(rows)
                {
                    prop_assert!(computed_in[row as usize].is_none());
                    computed_in[row as usize] = Some(plan.tile_group[p]);
                }
            }
            let mut sent = vec![0u32; rows as usize];
            let mut received = vec![0u32; (0..world).map(|p| matrix[p][r]).sum::<u64>() as usize];
            let starts = offsets(&matrix[r]);
            for (g, group) in plan.groups.iter().enumerate() {
                for e in &group.exchanges {
                    let d = e.peer as usize;
                    prop_assert!(
                        e.send_row >= starts[d]
                            && e.send_row + e.send_rows <= starts[d] + matrix[r][d]
                    );
                    for row in e.send_row..e.send_row + e.send_rows {
                        sent[row as usize] += 1;
                        prop_assert!(computed_in[row as usize].is_some_and(|c| c as usize <= g));
                    }
                    let peer = &plans[d].groups[g].exchanges[r];
                    prop_assert_eq!(peer.send_rows, e.recv_rows);
                    for row in e.recv_row..e.recv_row + e.recv_rows {
                        received[row as usize] += 1;
                    }
                }
            }
            prop_assert!(sent.iter().all(|&c| c == 1));
            prop_assert!(received.iter().all(|&c| c == 1));
        }
        Ok(())
    }

    #[test]
    fn the_natural_layout_tiles_a_skew_like_cublas() {
        // 819 + 1229 rows: 16 bands where padded destinations take 17.
        let matrix = vec![vec![819, 1229], vec![819, 1229]];
        for groups in [1, 2, 4, 16] {
            check_natural(&matrix, groups, 1).unwrap();
            check_natural(&matrix, groups, 4).unwrap();
        }
        assert_eq!(
            natural_phases(&[819, 1229, 5]),
            vec![0, 819 % 128, 2048 % 128]
        );
        let m = vec![vec![819, 1229], vec![300, 5]];
        assert_eq!(recv_phases(&m, 1).unwrap(), vec![819 % 128, 300 % 128]);
        assert!(recv_phases(&m, 2).is_err() && recv_phases(&[vec![1]], 0).is_ok());
        assert!(recv_phases(&[vec![1, 2], vec![3]], 0).is_err());
        // The band rows 768..896 holds both destinations' rows: computed in group 0 (destination
        // 1's first part), though destination 0 sends rows 768..819 in its last group.
        let bands = natural_bands(&[819, 1229], 2, 128);
        assert!(bands[0].contains(&6) && !bands[1].contains(&6));
        assert_eq!(bands.iter().map(Vec::len).sum::<usize>(), 16);
    }

    #[test]
    fn segments_are_whole_bands_so_groups_add_no_tiles() {
        // 819 + 1229 rows (a 60% skew of 2048): 7 + 10 bands at every group
        // count, each destination's partial band computed once.
        let one =
            plan_gemm_all_to_all(&[819, 1229], &[819, 1229], 256, TILE, 1, Layout::Padded).unwrap();
        for groups in [2, 4, 7, 16, 40] {
            let plan = plan_gemm_all_to_all(
                &[819, 1229],
                &[819, 1229],
                256,
                TILE,
                groups,
                Layout::Padded,
            )
            .unwrap();
            assert_eq!(
                plan.tile_order.len(),
                one.tile_order.len(),
                "{groups} groups"
            );
            assert_eq!(plan.send_buffer_rows, (7 + 10) * 128);
            for rows in [819, 1229] {
                // Every part starts on a band; only the last may end inside one.
                for g in 0..groups {
                    let (a, b) = (part(rows, g, groups), part(rows, g + 1, groups));
                    assert!(a % 128 == 0 && a <= b && (b % 128 == 0 || b == rows));
                }
            }
        }
        assert_eq!(part(819, 1, 2), 384);
        assert_eq!(part(819, 2, 2), 819);
        assert_eq!(part(100, 1, 4), 0);
        assert_eq!(part(100, 3, 4), 0);
        assert_eq!(part(100, 4, 4), 100);
    }

    #[test]
    fn skewed_routing_with_an_empty_pair() {
        // Rank 0 sends nothing to rank 2; rank 1 receives most rows.
        let matrix = vec![vec![300, 700, 0], vec![5, 1000, 129], vec![77, 2000, 1]];
        check_world(&matrix, 4, 1).unwrap();
        check_world(&matrix, 4, 3).unwrap();
    }

    /// Pushed on 2 ranks (natural layout), reading the store rows as the
    /// kernel does: every row a rank sends the peer lands once in the
    /// peer's slot, at the block's phase plus its index, inside the slot
    /// rows the block fills, pushed in a group no later than the one the
    /// receiver lands it in; every own row is stored here once, at its x
    /// row; and each group pushes as many tiles as the receiver counts.
    fn check_pushed(matrix: &[Vec<u64>], groups: u32, raster: u32) -> Result<(), TestCaseError> {
        let bm = u64::from(TILE.bm);
        let recv = |r: usize| -> Vec<u64> { (0..2).map(|p| matrix[p][r]).collect() };
        let plans: Vec<AllToAllPlan> = (0..2)
            .map(|r| {
                let phases = recv_phases(matrix, r).unwrap();
                let layout = Layout::Natural {
                    recv_phases: &phases,
                };
                plan_gemm_all_to_all(&matrix[r], &recv(r), 200, TILE, groups, layout)
                    .unwrap()
                    .rastered(raster)
            })
            .collect();
        for (me, plan) in plans.iter().enumerate() {
            let peer = 1 - me;
            let total: u64 = matrix[me].iter().sum();
            let start = offsets(&matrix[me])[peer];
            let (sent, phase) = (matrix[me][peer], start % bm);
            let end = pushed_slot_rows(sent, phase, bm);
            let rows = pushed_store_rows(plan, me as u32, &matrix[me], bm);
            prop_assert_eq!(rows.len(), plan.store_rows.len());
            // Slot row -> (x row, group pushing it, writes); x row -> writes here.
            let mut slot = vec![(0u64, 0usize, 0u32); end as usize];
            let mut here = vec![0u32; total as usize];
            let mut pushed = vec![0u32; groups as usize];
            for (p, &word) in rows.iter().enumerate() {
                let stored = word as i32;
                let g = plan.tile_group[p] as usize;
                let load = u64::from(plan.load_rows[p]);
                let dual = stored < 0 && (!stored as u64 & MAX_TABLE_ROWS) != 0;
                let local = (stored >= 0)
                    .then_some(u64::from(word))
                    .or(dual.then_some(load));
                let first_column = plan.tile_order[p] % plan.tiles_n == 0;
                if stored < 0 {
                    pushed[g] += 1;
                    let at = !stored as u64 & (MAX_TABLE_ROWS - 1);
                    prop_assert!(at % bm == 0 && at + bm <= end, "slot row {}", at);
                    for i in (0..bm).filter(|_| first_column) {
                        let x = load + i;
                        if (start..start + sent).contains(&x) {
                            prop_assert_eq!(at + i, phase + x - start);
                            slot[(at + i) as usize] = (x, g, slot[(at + i) as usize].2 + 1);
                        }
                    }
                }
                if let Some(row) = local {
                    prop_assert_eq!(row, load);
                    for x in (row..(row + bm).min(total)).filter(|_| first_column) {
                        if !(start..start + sent).contains(&x) {
                            here[x as usize] += 1;
                        }
                    }
                }
            }
            prop_assert!(here
                .iter()
                .enumerate()
                .all(|(x, &w)| w == u32::from(!(start..start + sent).contains(&(x as u64)))));
            // The receiver's view: group g's rows from `me` at the phase
            // plus their index in the block, pushed no later than g.
            let theirs = &plans[peer];
            prop_assert_eq!(theirs.recv_phases[me], phase);
            let counted = pushed_tiles(&matrix[me], peer, groups, bm, theirs.tiles_n);
            for g in 0..groups as usize {
                prop_assert_eq!(pushed[g], counted[g], "group {}", g);
                let e = theirs.groups[g].exchanges[me];
                let first = theirs.recv_part(&recv(peer), me, g as u32);
                for i in first..first + e.recv_rows {
                    let (x, pushed_in, writes) = slot[(phase + i) as usize];
                    prop_assert_eq!(writes, 1);
                    prop_assert!(pushed_in <= g);
                    prop_assert_eq!(x, start + i);
                }
            }
        }
        Ok(())
    }

    #[test]
    fn pushed_rows_land_where_the_receiver_reads() {
        for raster in [1, 2, 16] {
            check_pushed(&[vec![300, 700], vec![0, 1000]], 4, raster).unwrap();
            check_pushed(&[vec![5, 0], vec![129, 1]], 3, raster).unwrap();
            check_pushed(&[vec![0, 0], vec![0, 0]], 2, raster).unwrap();
            // The bench's skew: 16 bands on each rank, 2 of them dual.
            check_pushed(&[vec![819, 1229], vec![819, 1229]], 4, raster).unwrap();
        }
    }

    /// Rastering permutes each group's positions and nothing else: the same
    /// (tile, row read, row stored) per group, blocks of `bands` bands
    /// walked column by column.
    #[test]
    fn rastering_reorders_inside_groups_only() {
        let plan =
            plan_gemm_all_to_all(&[700, 1300], &[700, 1300], 512, TILE, 3, Layout::Padded).unwrap();
        let tiles_n = plan.tiles_n as usize;
        assert_eq!(tiles_n, 4);
        let rastered = plan.clone().rastered(4);
        assert_eq!(rastered.groups, plan.groups);
        assert_eq!(plan.clone().rastered(1), plan);
        let triples = |p: &AllToAllPlan, g: &AllToAllGroup| {
            let mut v: Vec<_> = g
                .positions
                .clone()
                .map(|i| {
                    let i = i as usize;
                    (
                        p.tile_order[i],
                        p.load_rows[i],
                        p.store_rows[i],
                        p.tile_group[i],
                    )
                })
                .collect();
            v.sort_unstable();
            v
        };
        for g in &plan.groups {
            assert_eq!(triples(&plan, g), triples(&rastered, g));
        }
        // Group 0's first block of 4 bands goes column 0 of each, then
        // column 1 ...; its last block holds the bands left over.
        let g0 = &rastered.groups[0];
        let entries: u64 = g0.exchanges.iter().map(|e| e.send_rows.div_ceil(128)).sum();
        assert_eq!(u64::from(g0.tiles), entries * tiles_n as u64);
        assert!(
            entries > 4 && entries % 4 != 0,
            "{entries} bands: one whole block and a short one"
        );
        let band = |i: usize| rastered.tile_order[i] as usize / tiles_n;
        let col = |i: usize| rastered.tile_order[i] as usize % tiles_n;
        let first = g0.positions.start as usize;
        let bands: Vec<usize> = (first..first + 4).map(band).collect();
        assert_eq!(bands, (band(first)..band(first) + 4).collect::<Vec<_>>());
        assert!((first..first + 4).all(|i| col(i) == 0));
        assert!((first + 4..first + 8).all(|i| col(i) == 1));
        let (end, short) = (g0.positions.end as usize, entries as usize % 4);
        assert!((end - short..end).all(|i| col(i) == tiles_n - 1));
        assert!(col(end - short - 1) == tiles_n - 2);
    }

    #[test]
    fn bad_splits_are_rejected() {
        assert!(plan_gemm_all_to_all(&[1, 2], &[3], 64, TILE, 2, Layout::Padded).is_err());
        assert!(plan_gemm_all_to_all(&[], &[], 64, TILE, 2, Layout::Padded).is_err());
        assert!(plan_gemm_all_to_all(&[1], &[1], 64, TILE, 0, Layout::Padded).is_err());
        let natural = |phases: &[u64]| {
            plan_gemm_all_to_all(
                &[1, 2],
                &[3, 4],
                64,
                TILE,
                2,
                Layout::Natural {
                    recv_phases: phases,
                },
            )
        };
        assert!(natural(&[0]).is_err());
        assert!(natural(&[0, 128]).is_err());
        assert!(natural(&[0, 127]).is_ok());
    }

    proptest! {
        #[test]
        fn pushes_agree_on_two_ranks(
            cells in prop::collection::vec(0u64..700, 4),
            groups in 1u32..9,
            raster in 1u32..6,
        ) {
            let matrix = vec![cells[0..2].to_vec(), cells[2..4].to_vec()];
            check_pushed(&matrix, groups, raster)?;
        }

        #[test]
        fn every_rank_agrees_on_every_exchange_in_both_layouts(
            world in 1usize..5,
            cells in prop::collection::vec(0u64..600, 16),
            groups in 1u32..9,
            raster in 1u32..6,
        ) {
            let matrix: Vec<Vec<u64>> = (0..world).map(|r| cells[r * 4..r * 4 + world].to_vec()).collect();
            check_world(&matrix, groups, raster)?;
            check_natural(&matrix, groups, raster)?;
        }
    }
}
