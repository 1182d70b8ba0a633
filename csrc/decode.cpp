// The attention over a plan's parts, per KV head: scores of every key part, softmax, and
// the product with every value part, heads split between threads.
//
// Factor-space attention (low-rank caches: x = a B + m with a token factor a of width r)
// places parts in the rows: a key part reads dims [qoff, qoff + D) of each query row (the
// query projected by the cache, q B^T) and may add a per-row shift to its scores (q . m);
// a value part adds its product p @ a into output dims [ooff, ooff + D) and may write its
// probability mass after them (the cache applies B and m after the op). A projected part
// carries its own B and m (per head, dense or token rows [B, H, r, Dp], read by the op's own
// key and value kernels as they read any part): a key part projects dims [qoff, qoff + Dp)
// of the queries itself and adds q . m; a value part adds (p @ a) B + (sum p) m into output
// dims [ooff, ooff + Dp). The cache's small per-head products then run inside the op, not
// as a dozen MLX ops a layer.
//
// A part shared by the KV heads (head stride 0) is read once for every head's rows: its
// scores for all heads first; as values, each head's softmax first, then the part's tokens
// split between the threads.
#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "parts.h"

namespace veloxquant {
namespace {

// exp(x) for x <= 0: 2^i * p(f) as in ops/attention.py (max relative error 1.9e-7);
// below 2^-127 it is exactly 0.
inline vf exp_nonpositive(vf x) {
  constexpr float c[6] = {1.8775767e-3f, 8.9893397e-3f, 5.5826318e-2f,
                          2.4015361e-1f, 6.9315308e-1f, 9.9999994e-1f};
  vf t = x * 1.4426950408889634f;
  t = t < -127.f ? vf{} - 127.f : t;
  vf i = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  i = i > t ? i - 1.f : i;
  const vf f = t - i;
  vf p = c[0] * f + c[1];
  for (int k = 2; k < 6; ++k) p = p * f + c[k];
  const vi e = (__builtin_convertvector(i, vi) + 127) << 23;
  return p * reinterpret_cast<const vf&>(e);
}

// Row softmax numerators in place; returns each row's sum.
std::vector<float> exp_rows(float* sc, int64_t R, int64_t S) {
  std::vector<float> den(R);
  for (int64_t r = 0; r < R; ++r) {
    float* row = sc + r * S;
    const float m = *std::max_element(row, row + S);
    vf sum = {};
    int64_t t = 0;
    for (; t + L <= S; t += L) {
      vf x;
      std::memcpy(&x, row + t, sizeof(vf));
      x = exp_nonpositive(x - m);
      std::memcpy(row + t, &x, sizeof(vf));
      sum += x;
    }
    vf x = vf{} - 1e30f;
    std::memcpy(&x, row + t, 4 * (S - t));
    x = exp_nonpositive(x - m);
    std::memcpy(row + t, &x, 4 * (S - t));
    den[r] = lane_sum(sum) + lane_sum(x);
  }
  return den;
}

std::vector<float> projection_mean(const Part& pt, int64_t b, int64_t h) {
  std::vector<float> m(pt.proj->D);
  load(pt.mean, pt.mean.at(b, h), pt.mean.stride[3], pt.proj->D, m.data());
  return m;
}

// Width of the query dims a key part reads (its projection's, when projected).
inline int64_t read_width(const Part& pt) { return pt.proj ? pt.proj->D : pt.D; }

// Width of the query rows a key part's kernel takes: the projected queries' (its rank), or
// the queries' own dims where the kernel rebuilds the keys.
inline int64_t query_width(const Part& pt) { return rebuilds(pt) ? pt.proj->D : pt.D; }

// Dims [qoff, qoff + D) of R query rows (stride Dq): R rows of D.
void query_dims(const float* q, int64_t R, int64_t Dq, int64_t qoff, int64_t D, float* out) {
  for (int64_t r = 0; r < R; ++r) std::copy_n(q + r * Dq + qoff, D, out + r * D);
}

// A key part's queries, R rows of query_width, from dims [qoff, qoff + read_width) of the
// query rows (stride Dq): copied, or projected onto its factor for head (b, h): q P^T is
// the scores of the query against P's rows, so the key kernels compute it from P's codes.
void part_queries(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R, int64_t Dq,
                  float* out) {
  if (!pt.proj || rebuilds(pt)) return query_dims(q, R, Dq, pt.qoff, query_width(pt), out);
  const Part& P = *pt.proj;
  std::vector<float> own;
  if (pt.qoff != 0 || P.D != Dq) own.resize(R * P.D), query_dims(q, R, Dq, pt.qoff, P.D, own.data());
  keys_into(P, b, h, own.empty() ? q : own.data(), R, out, pt.D);
}

// A key part's per-row score shift: given (q . m, computed by the cache), or its
// projection's mean (q . m here); empty without.
std::vector<float> score_shift(const Part& pt, int64_t b, int64_t h, const float* q, int64_t R,
                               int64_t Dq) {
  std::vector<float> shift;
  if (pt.has_shift) {
    shift.resize(R);
    load(pt.shift, pt.shift.at(b, h), pt.shift.stride[2], R, shift.data());
  } else if (pt.proj && !rebuilds(pt)) {
    const auto m = projection_mean(pt, b, h);
    for (int64_t r = 0; r < R; ++r)
      shift.push_back(std::inner_product(m.begin(), m.end(), q + r * Dq + pt.qoff, 0.f));
  }
  return shift;
}

// Scores of a key part's R query rows (of query_width) for each head h .. h + nh: a part
// shared by the heads is read once for all of them.
void scores_into(const Part& pt, int64_t b, int64_t h, int64_t nh, const float* q, int64_t R,
                 float* out, int64_t ld) {
  if (rebuilds(pt)) return rebuilt_keys(pt, b, h, nh, q, R, out, ld);
  keys_into(pt, b, h, q, nh * R, out, ld);
}

// Scores of a key part placed at dims [qoff, ...) of the query rows (stride Dq), plus its
// per-row shift; `pre`: the head's rows of scores computed for every head at once.
void placed_keys(const Part& pt, int64_t b, int64_t h, const std::vector<float>& q, int64_t Dq,
                 int64_t R, float* out, int64_t ld, const float* pre) {
  if (pre != nullptr) {
    for (int64_t r = 0; r < R; ++r) std::copy_n(pre + (h * R + r) * pt.n, pt.n, out + r * ld);
  } else if (pt.qoff == 0 && pt.D == Dq && !pt.proj) {
    keys_into(pt, b, h, q.data(), R, out, ld);
  } else {
    std::vector<float> own(R * query_width(pt));
    part_queries(pt, b, h, q.data(), R, Dq, own.data());
    scores_into(pt, b, h, 1, own.data(), R, out, ld);
  }
  const auto shift = score_shift(pt, b, h, q.data(), R, Dq);
  for (size_t r = 0; r < shift.size(); ++r)
    for (int64_t t = 0; t < pt.n; ++t) out[r * ld + t] += shift[r];
}

// Head (b, h)'s R rows of a value part's p @ V (own [R, D]) added into output dims
// [ooff, ooff + D) of acc (stride Dout), and the part's probability mass into dim ooff + D;
// projected into dims [ooff, ooff + Dp): own P + mass m, where own P weighs P's rows as
// probabilities weigh tokens, so the value kernels compute it from P's codes.
void place_values(const Part& pt, int64_t b, int64_t h, const float* own, const float* p,
                  int64_t ld, int64_t R, float* acc, int64_t Dout) {
  const int64_t D = read_width(pt);
  std::vector<float> sum;
  if (pt.proj) sum.assign(R * D, 0.f), values_into(*pt.proj, b, h, own, pt.D, R, sum.data());
  const std::vector<float> m = pt.proj ? projection_mean(pt, b, h) : std::vector<float>();
  for (int64_t r = 0; r < R; ++r) {
    float* o = acc + r * Dout + pt.ooff;
    const float* x = pt.proj ? sum.data() + r * D : own + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] += x[d];
    if (!pt.proj && !pt.mass) continue;
    const float mass = std::accumulate(p + r * ld, p + r * ld + pt.n, 0.f);
    if (pt.proj) {
      for (int64_t d = 0; d < D; ++d) o[d] += mass * m[d];
    } else {
      o[D] += mass;
    }
  }
}

void placed_values(const Part& pt, int64_t b, int64_t h, const float* p, int64_t ld, int64_t R,
                   float* acc, int64_t Dout) {
  if (pt.ooff == 0 && pt.D == Dout && !pt.mass && !pt.proj)
    return values_into(pt, b, h, p, ld, R, acc);
  std::vector<float> own(R * pt.D, 0.f);
  values_into(pt, b, h, p, ld, R, own.data());
  place_values(pt, b, h, own.data(), p, ld, R, acc, Dout);
}

// Scores of batch row b's key parts shared by the KV heads, for every head's rows: [b][part]
// -> [H * R, n] (empty for parts of each head's own).
using Shared = std::vector<std::vector<std::vector<float>>>;

// Whether a key part is one view shared by the KV heads (a low-rank token factor): its
// codes are then unpacked once for every head's rows, not once per head.
bool shared_by_heads(const Plan& pl, const Part& pt) {
  return pl.H > 1 && pt.kind != kChannel && pt.a.stride[1] == 0 && pt.s.stride[1] == 0 &&
         pt.z.stride[1] == 0;
}

// Tokens t0..t1 of a token or dense part.
Part tokens(Part pt, int64_t t0, int64_t t1) {
  pt.a.data += t0 * pt.a.stride[2];
  if (pt.s.data != nullptr) pt.s.data += t0 * pt.s.stride[2];
  if (pt.z.data != nullptr) pt.z.data += t0 * pt.z.stride[2];
  pt.rot_first += t0;
  pt.n = t1 - t0;
  return pt;
}

// Scores of every key part shared by the KV heads, for every head's rows: each part's
// queries for all heads first, then one start of the threads for all parts, each thread
// scoring its share of every part's tokens (a thread start costs tens of microseconds).
Shared shared_scores(const Plan& pl, int threads) {
  const bool own = pl.rows.size() > 1;
  const int64_t R = pl.R, HR = pl.H * R;
  struct Job {
    const Part* pt;
    int64_t pb;
    std::vector<float> q;
    float* sc;
  };
  Shared out(pl.B);
  for (int64_t b = 0; b < pl.B; ++b)
    for (const auto& pt : pl.rows[own ? b : 0].keys)
      out[b].emplace_back(shared_by_heads(pl, pt) ? HR * pt.n : 0);
  std::vector<Job> jobs;
  for (int64_t b = 0; b < pl.B; ++b) {
    const auto& keys = pl.rows[own ? b : 0].keys;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (out[b][i].empty()) continue;
      const Part& pt = keys[i];
      const int64_t D = query_width(pt);
      Job job{&pt, own ? 0 : b, std::vector<float>(HR * D), out[b][i].data()};
      for (int64_t h = 0; h < pl.H; ++h)
        part_queries(pt, job.pb, h, load_matrix(pl.q, b, h, R, pl.D).data(), R, pl.D,
                     job.q.data() + h * R * D);
      jobs.push_back(std::move(job));
    }
  }
  if (jobs.empty()) return out;
  on_threads(threads, [&](int w) {
    for (const auto& job : jobs) {
      const int64_t n = job.pt->n, step = (n + threads * L - 1) / (threads * L) * L;
      const int64_t t0 = w * step, t1 = std::min(n, t0 + step);  // whole lane blocks
      if (t0 < t1)
        scores_into(tokens(*job.pt, t0, t1), job.pb, 0, pl.H, job.q.data(), R, job.sc + t0, n);
    }
  });
  return out;
}

// Head (b, h)'s rows: exponentiated scores over every key part into sc [R, S], their
// sums returned.
std::vector<float> head_probs(const Plan& pl, const Shared& shared, int64_t b, int64_t h,
                              float* sc) {
  const bool own = pl.rows.size() > 1;
  const Parts& ps = pl.rows[own ? b : 0];
  const int64_t R = pl.R, S = ps.S, pb = own ? 0 : b;
  const auto q = load_matrix(pl.q, b, h, R, pl.D);
  int64_t off = 0;
  for (size_t i = 0; i < ps.keys.size(); ++i) {
    const auto& pt = ps.keys[i];
    const auto& pre = shared[b][i];
    placed_keys(pt, pb, h, q, pl.D, R, sc + off, S, pre.empty() ? nullptr : pre.data());
    off += pt.n;
  }
  if (pl.causal > 0) mask_causal(sc, R, S, pl.causal);
  return exp_rows(sc, R, S);
}

// Head (b, h)'s value parts into acc [R, Dv], but those `skip` marks (read for every head
// at once).
void head_values(const Plan& pl, int64_t b, int64_t h, const float* sc, float* acc,
                 const std::vector<char>& skip) {
  const bool own = pl.rows.size() > 1;
  const Parts& ps = pl.rows[own ? b : 0];
  int64_t off = 0;
  for (size_t i = 0; i < ps.values.size(); ++i) {
    const auto& pt = ps.values[i];
    if (skip.empty() || !skip[i])
      placed_values(pt, own ? 0 : b, h, sc + off, ps.S, pl.R, acc, pl.Dv);
    off += pt.n;
  }
}

void normalize(const float* acc, const std::vector<float>& den, int64_t R, int64_t Dv, float* out) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < Dv; ++d) out[r * Dv + d] = acc[r * Dv + d] / den[r];
}

void attend_head(const Plan& pl, const Shared& shared, int64_t b, int64_t h, float* out) {
  const int64_t S = pl.rows[pl.rows.size() > 1 ? b : 0].S;
  std::vector<float> sc(pl.R * S), acc(pl.R * pl.Dv, 0.f);
  const auto den = head_probs(pl, shared, b, h, sc.data());
  head_values(pl, b, h, sc.data(), acc.data(), {});
  normalize(acc.data(), den, pl.R, pl.Dv, out);
}

// Value parts one view shared by the KV heads (a low-rank token factor), where every head's
// scores fit kSharedScores floats: their codes are then unpacked once for all heads' rows.
constexpr int64_t kSharedScores = int64_t{1} << 21;

std::vector<char> values_shared(const Plan& pl, const Parts& ps) {
  std::vector<char> out;
  if (pl.H * pl.R * ps.S > kSharedScores) return out;
  bool any = false;
  for (const auto& pt : ps.values) out.push_back(shared_by_heads(pl, pt)), any |= out.back();
  if (!any) out.clear();
  return out;
}

// Batch row b in two phases: every head's scores and own value parts (heads split between
// the threads), then each shared value part for all heads' rows at once (tokens split).
void attend_row_shared(const Plan& pl, const Shared& shared, int64_t b, float* out, int threads,
                       const std::vector<char>& skip) {
  const bool own = pl.rows.size() > 1;
  const Parts& ps = pl.rows[own ? b : 0];
  const int64_t H = pl.H, R = pl.R, S = ps.S, HR = H * R;
  std::vector<float> sc(HR * S), acc(HR * pl.Dv, 0.f);
  std::vector<std::vector<float>> den(H);
  const int nt = static_cast<int>(std::min<int64_t>(threads, H));
  on_threads(nt, [&](int w) {
    for (int64_t h = w; h < H; h += nt) {
      den[h] = head_probs(pl, shared, b, h, sc.data() + h * R * S);
      head_values(pl, b, h, sc.data() + h * R * S, acc.data() + h * R * pl.Dv, skip);
    }
  });
  // The shared parts (their first token at off), all in one start of the threads: each
  // thread sums its share of every part's tokens into its own buffer.
  std::vector<std::pair<const Part*, int64_t>> parts;
  for (size_t i = 0, off = 0; i < ps.values.size(); off += ps.values[i].n, ++i)
    if (skip[i]) parts.emplace_back(&ps.values[i], off);
  std::vector<std::vector<std::vector<float>>> sums(parts.size());
  for (size_t k = 0; k < parts.size(); ++k)
    sums[k].assign(threads, std::vector<float>(HR * parts[k].first->D, 0.f));
  on_threads(threads, [&](int w) {
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto [pt, off] = parts[k];
      const int64_t step = (pt->n + threads - 1) / threads;
      const int64_t t0 = w * step, t1 = std::min(pt->n, t0 + step);
      if (t0 < t1)
        values_into(tokens(*pt, t0, t1), own ? 0 : b, 0, sc.data() + off + t0, S, HR,
                    sums[k][w].data());
    }
  });
  for (size_t k = 0; k < parts.size(); ++k) {
    const auto [pt, off] = parts[k];
    auto& sum = sums[k][0];
    for (int w = 1; w < threads; ++w)
      for (int64_t i = 0; i < HR * pt->D; ++i) sum[i] += sums[k][w][i];
    for (int64_t h = 0; h < H; ++h)
      place_values(*pt, own ? 0 : b, h, sum.data() + h * R * pt->D, sc.data() + h * R * S + off,
                   S, R, acc.data() + h * R * pl.Dv, pl.Dv);
  }
  for (int64_t h = 0; h < H; ++h)
    normalize(acc.data() + h * R * pl.Dv, den[h], R, pl.Dv, out + (b * H + h) * R * pl.Dv);
}

}  // namespace

void attend(const Plan& pl, float* out, int threads) {
  const Shared shared = shared_scores(pl, threads);
  std::vector<int64_t> per_head;  // batch rows without shared value parts
  for (int64_t b = 0; b < pl.B; ++b) {
    const auto skip = values_shared(pl, pl.rows[pl.rows.size() > 1 ? b : 0]);
    if (skip.empty()) {
      for (int64_t h = 0; h < pl.H; ++h) per_head.push_back(b * pl.H + h);
    } else {
      attend_row_shared(pl, shared, b, out, threads, skip);
    }
  }
  const int64_t n = static_cast<int64_t>(per_head.size());
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  on_threads(nt, [&](int w) {
    for (int64_t i = w; i < n; i += nt) {
      const int64_t bh = per_head[i];
      attend_head(pl, shared, bh / pl.H, bh % pl.H, out + bh * pl.R * pl.Dv);
    }
  });
}

}  // namespace veloxquant
