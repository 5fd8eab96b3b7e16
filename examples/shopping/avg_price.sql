-- Average price per item from the two views: every item has one price (10, 20, ... 100),
-- so a row with any other avg_price read the views at two different moments.
SELECT a.item_id, sum(a.amount) AS units, round(sum(p.price) / sum(a.amount), 2) AS avg_price
FROM lake.shop.user_item_amount a JOIN lake.shop.user_item_price p USING (user_id, item_id)
GROUP BY a.item_id ORDER BY a.item_id
