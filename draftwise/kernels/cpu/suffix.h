// Suffix decoding's per-step search (spec_decode/suffix.py, spec_decode/datastore.py), scalar C++.
//
// The numpy versions in those files define the results; these return exactly the same drafts,
// without numpy's per-operation cost: a step searches three corpora (the request's own tokens,
// earlier outputs, the datastore) with ~50 small numpy operations each, ~160 us a request on
// Zen 4, which is 3-4 % of a SmolLM2 step at batch 1 and a third of one at batch 4 (drafting for 4
// requests) - where the allocation then decides drafting does not pay. No ISA-specific code: the
// header is shared by every ISA module.
#pragma once

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace draftwise {

namespace py = pybind11;

constexpr int64_t kSeparator = -1;   // between sequences of a corpus: never matches a token

// A read-only view of a 1-D token corpus held as int32 (the datastore) or int64 (the indexes).
struct TokenView {
  const int32_t* p32 = nullptr;
  const int64_t* p64 = nullptr;
  int64_t n = 0;
  int64_t operator[](int64_t i) const { return p64 ? p64[i] : static_cast<int64_t>(p32[i]); }
};

inline TokenView token_view(const py::array& a) {
  TORCH_CHECK(a.ndim() == 1 && (a.flags() & py::array::c_style), "tokens: a contiguous 1-D array");
  TokenView v;
  v.n = a.shape(0);
  if (a.dtype().is(py::dtype::of<int64_t>()))
    v.p64 = static_cast<const int64_t*>(a.data());
  else if (a.dtype().is(py::dtype::of<int32_t>()))
    v.p32 = static_cast<const int32_t*>(a.data());
  else
    TORCH_CHECK(false, "tokens: int32 or int64");
  return v;
}

// match_lengths + the candidates of the longest: for each candidate end position p, the length of
// the common suffix of `context` and buf[: p + 1] (at least `known`, at most `max_depth`); returns
// that longest length and the candidates reaching it, in their order.
inline std::pair<int64_t, py::array_t<int64_t>> suffix_longest_match(const py::array& buf, const py::array& cand,
                                                                     const py::array& context, int64_t known,
                                                                     int64_t max_depth) {
  const TokenView b = token_view(buf), c = token_view(cand), ctx = token_view(context);
  const int64_t depth_end = std::min(max_depth, ctx.n);
  std::vector<int64_t> len(c.n, known);
  int64_t best = c.n ? known : 0;
  for (int64_t i = 0; i < c.n; ++i) {
    int64_t m = known;
    for (int64_t d = known; d < depth_end; ++d) {
      const int64_t at = c[i] - d;
      if (at < 0 || b[at] != ctx[ctx.n - 1 - d]) break;
      ++m;
    }
    len[i] = m;
    best = std::max(best, m);
  }
  std::vector<int64_t> keep;
  for (int64_t i = 0; i < c.n; ++i)
    if (len[i] == best) keep.push_back(c[i]);
  py::array_t<int64_t> out(static_cast<py::ssize_t>(keep.size()));
  std::copy(keep.begin(), keep.end(), out.mutable_data());
  return {best, out};
}

// _chain_draft: from the occurrences `occ` (end positions of the matched suffix) of a corpus of n
// tokens, the chain of most frequent continuations up to `limit` tokens; each token's probability
// is the share of all occurrences still continuing along the chain. Where the remaining
// occurrences disagree, the most frequent token wins (ties: the smallest id, as numpy's
// unique + argmax); the chain stops at a probability below `min_token_prob` or where every
// remaining occurrence ends.
inline std::pair<std::vector<int64_t>, std::vector<double>> suffix_chain(const py::array& buf, int64_t n,
                                                                         const py::array& occurrences, int64_t limit,
                                                                         double min_token_prob) {
  const TokenView b = token_view(buf), occ = token_view(occurrences);
  std::vector<int64_t> tokens;
  std::vector<double> probs;
  const int64_t total = occ.n;
  if (total == 0 || limit <= 0) return {tokens, probs};
  auto cont = [&](int64_t row, int64_t depth) -> int64_t {   // token `depth` after occurrence `row`
    const int64_t at = row + 1 + depth;
    return at < n ? b[at] : kSeparator;
  };
  std::vector<int64_t> rows(total);
  for (int64_t i = 0; i < total; ++i) rows[i] = occ[i];
  std::vector<std::pair<int64_t, int64_t>> counted;   // (token, count) of one column
  int64_t depth = 0;
  while (depth < limit) {
    // the run of columns every remaining occurrence shares
    int64_t run = 0;
    for (int64_t d = depth; d < limit; ++d) {
      const int64_t first = cont(rows[0], d);
      bool agree = first != kSeparator;
      for (size_t r = 1; agree && r < rows.size(); ++r) agree = cont(rows[r], d) == first;
      if (!agree) break;
      ++run;
    }
    if (run) {
      const double p = static_cast<double>(rows.size()) / static_cast<double>(total);
      if (p < min_token_prob) break;
      for (int64_t d = depth; d < depth + run; ++d) {
        tokens.push_back(cont(rows[0], d));
        probs.push_back(p);
      }
      depth += run;
      continue;
    }
    counted.clear();
    for (int64_t row : rows) {
      const int64_t t = cont(row, depth);
      if (t == kSeparator) continue;
      auto it = std::find_if(counted.begin(), counted.end(), [t](const auto& c) { return c.first == t; });
      if (it == counted.end())
        counted.emplace_back(t, 1);
      else
        ++it->second;
    }
    if (counted.empty()) break;
    std::pair<int64_t, int64_t> top = counted[0];
    for (const auto& c : counted)
      if (c.second > top.second || (c.second == top.second && c.first < top.first)) top = c;
    const double p = static_cast<double>(top.second) / static_cast<double>(total);
    if (p < min_token_prob) break;
    tokens.push_back(top.first);
    probs.push_back(p);
    std::vector<int64_t> next;
    for (int64_t row : rows)
      if (cont(row, depth) == top.first) next.push_back(row);
    rows.swap(next);
    ++depth;
  }
  return {tokens, probs};
}

// Datastore.matches' narrowing: within the backward suffix array `order` over `buf`, rows [lo, hi)
// share the context's last token; each further context token (backwards) narrows them to the rows
// whose key at that depth equals it (keys sorted within the range), while any remain. Returns the
// final (lo, hi) and the suffix length matched.
inline std::tuple<int64_t, int64_t, int64_t> suffix_array_narrow(const py::array& order_arr, const py::array& buf,
                                                                 int64_t lo, int64_t hi, const py::array& context,
                                                                 int64_t max_depth) {
  const TokenView order = token_view(order_arr), b = token_view(buf), ctx = token_view(context);
  auto key = [&](int64_t row, int64_t d) -> int64_t {
    const int64_t p = order[row] - d;
    return p >= 0 ? b[p] : -2;
  };
  int64_t depth = 1;
  const int64_t end = std::min(max_depth, ctx.n);
  for (int64_t d = 1; d < end; ++d) {
    const int64_t want = ctx[ctx.n - 1 - d];
    int64_t a = lo, z = hi;                 // first row with key >= want
    while (a < z) {
      const int64_t mid = (a + z) / 2;
      if (key(mid, d) < want) a = mid + 1; else z = mid;
    }
    int64_t c = a, y = hi;                  // first row with key > want
    while (c < y) {
      const int64_t mid = (c + y) / 2;
      if (key(mid, d) <= want) c = mid + 1; else y = mid;
    }
    if (a >= c) break;
    lo = a;
    hi = c;
    depth = d + 1;
  }
  return {lo, hi, depth};
}

}  // namespace draftwise
